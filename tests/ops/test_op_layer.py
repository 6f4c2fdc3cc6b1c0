"""The op layer (CPU): one torch op per family (+ .out and the *_snapshot variants, every feature an argument),
out= in the public functions, the error classes, and backward refused.

* torch.ops.attnres holds at most 10 op names, none a per-feature variant (`*_fp8`, `*_persistent`).
* out= returns the caller's tensors, bit for bit the out-of-place results, for every family with and without
  the FP8 outputs, the mixture tap and the snapshot write; a malformed out= (shape, dtype, an output overlapping
  an input) raises ArgumentError and writes nothing.
* the `.out` overloads traced whole by torch.compile(fullgraph=True) give eager's bits.
* attnres.AttnResError is the base of ArgumentError (also a ValueError), UnsupportedError and CudaError, all
  of module `attnres`; a traceback names `attnres.ArgumentError`.
* a functional op's outputs carry a backward that raises UnsupportedError naming the op; an op writing into
  caller tensors (out=, .out, the snapshot ops) refuses inputs that require grad at call time.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch

import attnres
from attnres import _C
from helpers import BF16, assert_same_bits, poison_

T, H, K = 3, 256, 2  # H a multiple of 128: block128 applies
EPS = (1e-5, 1e-6)
FP8 = torch.float8_e4m3fn


def _inputs(seed=0, spare_rows=2):
    """layer_residual, two addends, a bank of K candidates plus spare snapshot rows (block = bank[:K]), weights."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(BF16)  # noqa: E731
    lr, add, add2 = r(T, H), r(T, H), r(T, H)
    bank = r(K + spare_rows, T, H)
    res_w, rms_w, norm_w = (1 + 0.1 * r(H)).to(BF16), (1 + 0.1 * r(H)).to(BF16), (1 + 0.1 * r(H)).to(BF16)
    return dict(lr=lr, add=add, add2=add2, bank=bank, res_w=res_w, rms_w=rms_w, norm_w=norm_w)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), (what, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b)), what


# ------------------------------------------------------------------------------------------------ the op count
def test_one_op_per_family():
    names = {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("attnres::")}
    assert len(names) <= 10, sorted(names)
    assert not [n for n in names if n.endswith(("_fp8", "_persistent"))], sorted(names)
    for family in ("attn_res", "attn_res_rmsnorm", "attn_res_add_rmsnorm"):
        for name in (family, family + "_snapshot"):
            assert f"attnres::{name}" in names, name
            assert set(getattr(torch.ops.attnres, name).overloads()) == {"default", "out"}, name


# ------------------------------------------------------------------------------------------------ out= calls
def _public(case, t, bank, **kw):
    """One public call of `case` (family, features): returns its result tuple."""
    family, feat = case
    feat = dict(feat)
    snapshot = feat.pop("snapshot", False)
    if snapshot:
        kw["snapshot_slot"] = K
    block = bank[:K]
    if "options" in feat:
        kw["options"] = feat.pop("options")
    if family == "attn_res":
        r = attnres.attn_res(t["lr"], block, t["res_w"], t["rms_w"], EPS[0], **feat, **kw)
    elif family == "attn_res_rmsnorm":
        r = attnres.attn_res_rmsnorm(t["lr"], block, t["res_w"], t["rms_w"], t["norm_w"], *EPS, **feat, **kw)
    else:
        r = attnres.attn_res_add_rmsnorm(t["lr"], t["add"], block, t["res_w"], t["rms_w"], t["norm_w"], *EPS,
                                         **feat, **kw)
    return r if isinstance(r, tuple) else (r,)


CASES = [
    ("attn_res", {}), ("attn_res", {"diagnostics": False}), ("attn_res", {"snapshot": True}),
    ("attn_res", {"diagnostics": False, "snapshot": True}),
    ("attn_res_rmsnorm", {}), ("attn_res_rmsnorm", {"return_mixture": True}),
    ("attn_res_rmsnorm", {"fp8": "per_token"}), ("attn_res_rmsnorm", {"fp8": "block128", "return_mixture": True}),
    ("attn_res_rmsnorm", {"fp8": "block128", "fp8_pow2_scales": True, "snapshot": True}),
    ("attn_res_rmsnorm", {"return_mixture": True, "snapshot": True}),
    ("attn_res_add_rmsnorm", {}), ("attn_res_add_rmsnorm", {"return_mixture": True}),
    ("attn_res_add_rmsnorm", {"layer_residual_add2": "add2", "return_mixture": True, "fp8": "per_token"}),
    ("attn_res_add_rmsnorm", {"fp8": "block128", "fp8_pow2_scales": True}),
    ("attn_res_add_rmsnorm", {"snapshot": True, "layer_residual_add2": "add2"}),
    ("attn_res_add_rmsnorm", {"snapshot": True, "return_mixture": True, "fp8": "per_token"}),
    ("attn_res_add_rmsnorm", {"options": attnres.Options(topology="persistent")}),
    ("attn_res_add_rmsnorm", {"options": attnres.Options(topology="persistent"), "fp8": "block128"}),
]


def _resolved(case, t):
    family, feat = case
    return family, {k: (t[v] if k == "layer_residual_add2" else v) for k, v in feat.items()}


def _poisoned_like(results):
    outs = []
    for r in results:
        o = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype)
        if o.is_floating_point() and o.dtype != FP8:
            poison_(o)
        else:
            o.view(torch.uint8).fill_(0x5A)
        outs.append(o)
    return tuple(outs)


@pytest.mark.parametrize("case", CASES, ids=[f"{f}-{'-'.join(sorted(k for k in feat)) or 'plain'}" for f, feat in CASES])
def test_out_returns_the_given_tensors_with_the_out_of_place_bits(case):
    t = _inputs()
    case = _resolved(case, t)
    bank_a, bank_b = t["bank"].clone(), t["bank"].clone()
    want = _public(case, t, bank_a)
    out = _poisoned_like(want)
    got = _public(case, t, bank_b, out=out)
    assert len(got) == len(want) and all(g is o for g, o in zip(got, out)), "out= must return the given tensors"
    for i, (g, w) in enumerate(zip(got, want)):
        _same(g, w, f"{case}: result #{i} with out= vs out of place")
    _same(bank_b, bank_a, f"{case}: the bank after the out= call")
    # None entries are allocated; the given ones are still returned as given
    partial = tuple(o if i % 2 else None for i, o in enumerate(_poisoned_like(want)))
    got = _public(case, t, t["bank"].clone(), out=partial)
    for i, (g, w, p) in enumerate(zip(got, want, partial)):
        assert p is None or g is p, i
        _same(g, w, f"{case}: result #{i} with a partly given out=")


def _torch_op_call(case, t, bank, outs=None):
    """The same case through torch.ops.attnres.<family>[_snapshot][.out]."""
    family, feat = case
    feat = dict(feat)
    snapshot = feat.pop("snapshot", False)
    opts = feat.pop("options", None)
    if opts is not None:
        feat["topology"] = opts.topology
    if family == "attn_res_add_rmsnorm":
        head = (t["lr"], t["add"], feat.pop("layer_residual_add2", None))
    else:
        head = (t["lr"],)
    cand = (bank, K, K) if snapshot else (bank[:K],)
    w = (t["res_w"], t["rms_w"]) + (() if family == "attn_res" else (t["norm_w"],))
    eps = EPS[:1] if family == "attn_res" else EPS
    packet = getattr(torch.ops.attnres, family + ("_snapshot" if snapshot else ""))
    if outs is None:
        return packet(*head, *cand, *w, *eps, **feat)
    return packet.out(*head, *cand, *w, *eps, **feat, **outs)


@pytest.mark.parametrize("case", CASES, ids=[f"{f}-{'-'.join(sorted(k for k in feat)) or 'plain'}" for f, feat in CASES])
def test_torch_ops_out_overload_equals_the_functional_op(case):
    t = _inputs(seed=1)
    case = _resolved(case, t)
    family = case[0]
    bank_a, bank_b = t["bank"].clone(), t["bank"].clone()
    want = _torch_op_call(case, t, bank_a)
    names = attnres._attn_ops.FAMILIES[family].outputs
    outs = {n: (None if w.numel() == 0 else p) for n, w, p in zip(names, want, _poisoned_like(want))}
    assert _torch_op_call(case, t, bank_b, outs) in (None, ())
    for n, w in zip(names, want):
        if outs[n] is None:
            assert w.shape == (0,), (case, n)  # absent outputs are empty (0,) tensors
        else:
            _same(outs[n], w, f"{case}: .out {n}")
    _same(bank_b, bank_a, f"{case}: the bank after .out")


# ------------------------------------------------------------------------------------ malformed out= write nothing
class Unchanged:
    def __init__(self, *tensors):
        self.tensors = [x for x in tensors if x is not None]

    def __enter__(self):
        self.before = [x.clone() for x in self.tensors]

    def __exit__(self, *exc):
        for i, (x, b) in enumerate(zip(self.tensors, self.before)):
            assert torch.equal(bits(x), bits(b)), f"tensor #{i} changed by a rejected call"
        return False


def _rows(dtype=BF16, cols=H):
    return poison_(torch.empty(T, cols, dtype=dtype)) if dtype != FP8 else torch.zeros(T, cols, dtype=dtype)


def _bad_out_cases(t):
    """(name, call(out), out tuple, message): each differs from a good out= in one entry."""
    lr, add, bank = t["lr"], t["add"], t["bank"]
    block = bank[:K]
    w3 = (t["res_w"], t["rms_w"], t["norm_w"])
    rms = lambda out, **kw: attnres.attn_res_rmsnorm(lr, block, *w3, *EPS, out=out, **kw)  # noqa: E731
    addn = lambda out, **kw: attnres.attn_res_add_rmsnorm(lr, add, block, *w3, *EPS, out=out, **kw)  # noqa: E731
    ar = lambda out, **kw: attnres.attn_res(lr, block, *w3[:2], EPS[0], out=out, **kw)  # noqa: E731
    diag = lambda dtype=torch.float32, n=K + 1: poison_(torch.empty(n, T, dtype=dtype))  # noqa: E731
    per_token = lambda: torch.empty(T, 1)  # noqa: E731
    return [
        ("rmsnorm-shape", rms, (_rows(cols=H + 8),),
         f"attn_res_rmsnorm: output must have shape [T, H] = [{T}, {H}], got [{T}, {H + 8}]"),
        ("rmsnorm-dtype", rms, (_rows(torch.float32),), "attn_res_rmsnorm: output must be bfloat16, got float32"),
        ("rmsnorm-overlaps-lr", rms, (lr,), "attn_res_rmsnorm: output overlaps layer_residual"),
        ("rmsnorm-overlaps-bank", rms, (bank[1],), "attn_res_rmsnorm: output overlaps block_residual"),
        ("rmsnorm-tap-overlaps-output", lambda out: rms(out, return_mixture=True), (None, None),
         "attn_res_rmsnorm: mixture overlaps output"),
        ("rmsnorm-fp8-codes-dtype", lambda out: rms(out, fp8="per_token"), (_rows(), _rows(), per_token()),
         "attn_res_rmsnorm: output_fp8 must be float8_e4m3fn, got bfloat16"),
        ("rmsnorm-fp8-scales-shape", lambda out: rms(out, fp8="per_token"), (_rows(), _rows(FP8), torch.empty(T, 2)),
         f"attn_res_rmsnorm: fp8_scales must have shape [T, 1] = [{T}, 1], got [{T}, 2]"),
        ("add-updated-overlaps-add", addn, (add, _rows()), "attn_res_add_rmsnorm: updated overlaps layer_residual_add"),
        ("add-output-dtype", addn, (_rows(), _rows(torch.float16)),
         "attn_res_add_rmsnorm: output must be bfloat16, got float16"),
        ("add-tap-shape", lambda out: addn(out, return_mixture=True), (_rows(), _rows(), _rows(cols=H - 8)),
         f"attn_res_add_rmsnorm: mixture must have shape [T, H] = [{T}, {H}], got [{T}, {H - 8}]"),
        ("attn_res-probs-dtype", ar, (_rows(), diag(), diag(BF16), diag()),
         "attn_res: probs must be float32, got bfloat16"),
        ("attn_res-logits-shape", ar, (_rows(), diag(), diag(), diag(n=K)),
         f"attn_res: logits must have shape [N, T] = [{K + 1}, {T}], got [{K}, {T}]"),
        ("out-count", rms, (_rows(), _rows()),
         "attn_res_rmsnorm: out must be a tuple of 1 tensors or None (output), got tuple of 2"),
        ("out-not-a-tuple", addn, _rows(),
         "attn_res_add_rmsnorm: out must be a tuple of 2 tensors or None (updated, output), got Tensor"),
    ]


def _bad_out_ids():
    return [c[0] for c in _bad_out_cases(_inputs())]


@pytest.mark.parametrize("which", _bad_out_ids())
def test_malformed_out_raises_and_writes_nothing(which):
    t = _inputs(seed=2)
    name, call, out, message = next(c for c in _bad_out_cases(t) if c[0] == which)
    if name == "rmsnorm-tap-overlaps-output":
        o = _rows()
        out = (o, o[:, :])  # the tap aliasing the output
    given = out if isinstance(out, tuple) else (out,)
    with Unchanged(*t.values(), *given), pytest.raises(attnres.ArgumentError, match="^" + re.escape(message)):
        call(out)


def test_malformed_out_through_the_torch_op_writes_nothing():
    t = _inputs(seed=3)
    lr, bank = t["lr"], t["bank"]
    w3 = (t["res_w"], t["rms_w"], t["norm_w"])
    op = torch.ops.attnres.attn_res_add_rmsnorm.out
    good = _rows()
    cases = [
        (dict(updated=good, output=lr), "attn_res_add_rmsnorm: output overlaps layer_residual"),
        (dict(updated=good, output=_rows(torch.float32)), "attn_res_add_rmsnorm: output must be bfloat16, got float32"),
        (dict(updated=good, output=_rows(cols=H + 8)),
         f"attn_res_add_rmsnorm: output must have shape [T, H] = [{T}, {H}], got [{T}, {H + 8}]"),
    ]
    for outs, message in cases:
        with Unchanged(*t.values(), *outs.values()), \
                pytest.raises(attnres.ArgumentError, match="^" + re.escape(message)):
            op(lr, t["add"], None, bank[:K], *w3, *EPS, **outs)
    with Unchanged(*t.values(), good), pytest.raises(attnres.ArgumentError, match=re.escape(
            "attn_res_rmsnorm_snapshot: writes into caller tensors") + "|" + re.escape(
            "attn_res_rmsnorm: snapshot_slot 9 lies outside the bank's")):
        torch.ops.attnres.attn_res_rmsnorm_snapshot.out(lr, bank, K, 9, *w3, *EPS, output=good)


def test_options_and_out_must_be_well_formed():
    t = _inputs()
    with Unchanged(*t.values()), pytest.raises(attnres.ArgumentError, match=re.escape(
            "attn_res_rmsnorm: options must be an attnres.Options, got str")):
        attnres.attn_res_rmsnorm(t["lr"], t["bank"][:K], t["res_w"], t["rms_w"], t["norm_w"], *EPS, options="auto")
    out = (_rows(), _rows(), _rows())
    with Unchanged(*t.values(), *out), pytest.raises(attnres.ArgumentError, match="^" + re.escape(
            "attn_res_rmsnorm: out must be a tuple of 1 tensors or None (output), got tuple") + " of 3$"):
        attnres.attn_res_rmsnorm(t["lr"], t["bank"][:K], t["res_w"], t["rms_w"], t["norm_w"], *EPS, out=out)


# --------------------------------------------------------------------------------------- the snapshot-bank rules
SNAPSHOT_OPS = {
    "attn_res": lambda t, bank, k, s: torch.ops.attnres.attn_res_snapshot(t["lr"], bank, k, s, t["res_w"], t["rms_w"],
                                                                          EPS[0]),
    "attn_res_rmsnorm": lambda t, bank, k, s: torch.ops.attnres.attn_res_rmsnorm_snapshot(
        t["lr"], bank, k, s, t["res_w"], t["rms_w"], t["norm_w"], *EPS),
    "attn_res_add_rmsnorm": lambda t, bank, k, s: torch.ops.attnres.attn_res_add_rmsnorm_snapshot(
        t["lr"], t["add"], None, bank, k, s, t["res_w"], t["rms_w"], t["norm_w"], *EPS),
}


@pytest.mark.parametrize("family", list(SNAPSHOT_OPS))
@pytest.mark.parametrize("k,slot,rule", [
    (7, 2, "num_snapshots 7 exceeds the bank's 4 rows"),
    (2, 4, "snapshot_slot 4 lies outside the bank's 4 rows (the bank must hold at least 5 snapshot rows)"),
    (-2, 2, "num_snapshots must be >= 0, got -2"),
    (-1, 2, "num_snapshots must be >= 0, got -1"),
    (-1, -1, "num_snapshots must be >= 0, got -1"),
    (-1, 4, "num_snapshots must be >= 0, got -1"),  # else row 4 (past the bank, inside its storage) is written
])
def test_snapshot_bank_rules_name_the_family(family, k, slot, rule):
    """Checked once in C++, one wording for every family; -1 is not a way to skip the bank (it is the
    library's internal "no snapshot" value)."""
    t = _inputs(seed=4)
    big = t["bank"].clone()
    full = torch.cat([big, torch.zeros(2, T, H, dtype=BF16)])  # rows past the bank, inside the storage
    bank = full[:4]
    with Unchanged(full, *t.values()), pytest.raises(attnres.ArgumentError) as e:
        SNAPSHOT_OPS[family](t, bank, k, slot)
    assert str(e.value) == f"{family}: {rule}"


def test_a_bank_view_past_its_storage_is_refused():
    """A bank whose rows lie past its storage (a storage shrunk under the view; as_strided under
    torch.compile is not bounds-checked) is refused before the library sees its pointers."""
    t = _inputs(seed=5)
    storage_rows = 2
    bank = t["bank"].clone()
    bank.untyped_storage().resize_(storage_rows * T * H * bank.element_size())
    with Unchanged(*t.values()), pytest.raises(attnres.ArgumentError, match=re.escape(
            "attn_res_rmsnorm: the bank's 4 rows lie outside its storage")):
        SNAPSHOT_OPS["attn_res_rmsnorm"](t, bank, 1, 2)


# --------------------------------------------------------------------------------------------- torch.compile
def _every_out_overload(lr, add, add2, bank, res_w, rms_w, norm_w, o):
    ops = torch.ops.attnres
    ops.attn_res.out(lr, bank[:K], res_w, rms_w, EPS[0], output=o["ar_out"], rsigma=o["ar_rsigma"],
                     probs=o["ar_probs"], logits=o["ar_logits"])
    ops.attn_res_snapshot.out(lr, bank, K, K, res_w, rms_w, EPS[0], diagnostics=False, output=o["ars_out"])
    ops.attn_res_rmsnorm.out(lr, bank[:K], res_w, rms_w, norm_w, *EPS, True, "block128", True, output=o["r_out"],
                             mixture=o["r_mix"], output_fp8=o["r_q"], fp8_scales=o["r_s"])
    ops.attn_res_rmsnorm_snapshot.out(lr, bank, K, K + 1, res_w, rms_w, norm_w, *EPS, output=o["rs_out"])
    ops.attn_res_add_rmsnorm.out(lr, add, add2, bank[:K], res_w, rms_w, norm_w, *EPS, fp8="per_token",
                                 updated=o["a_upd"], output=o["a_out"], output_fp8=o["a_q"], fp8_scales=o["a_s"])
    ops.attn_res_add_rmsnorm_snapshot.out(lr, add, None, bank, K, K, res_w, rms_w, norm_w, *EPS, True,
                                          updated=o["as_upd"], output=o["as_out"], mixture=o["as_mix"])
    ops.attn_res_add_rmsnorm.out(lr, add, None, bank[:K], res_w, rms_w, norm_w, *EPS, topology="persistent",
                                 updated=o["p_upd"], output=o["p_out"])
    return torch.nn.functional.silu(o["a_out"].float()).to(BF16)  # a following PyTorch op in the same graph


def _out_buffers():
    rows = ("ar_out", "ars_out", "r_out", "r_mix", "rs_out", "a_upd", "a_out", "as_upd", "as_out", "as_mix",
            "p_upd", "p_out")
    o = {k: _rows() for k in rows}
    o.update({k: poison_(torch.empty(K + 1, T)) for k in ("ar_rsigma", "ar_probs", "ar_logits")})
    o["r_q"], o["a_q"] = _rows(FP8), _rows(FP8)
    o["r_s"] = attnres.fp8.empty_scales("block128", T, H, "cpu")
    o["a_s"] = torch.empty(T, 1)
    return o


def test_out_overloads_under_compile_fullgraph_equal_eager():
    torch._dynamo.reset()
    t = _inputs(seed=6)
    args = (t["lr"], t["add"], t["add2"])
    w = (t["res_w"], t["rms_w"], t["norm_w"])
    eager_bank, compiled_bank = t["bank"].clone(), t["bank"].clone()
    eager_o, compiled_o = _out_buffers(), _out_buffers()
    e = _every_out_overload(*args, eager_bank, *w, eager_o)
    c = torch.compile(_every_out_overload, fullgraph=True)(*args, compiled_bank, *w, compiled_o)
    assert_same_bits(c, e, "the following op")
    for k in eager_o:
        assert torch.equal(bits(compiled_o[k]), bits(eager_o[k])), f"compiled .out {k}"
    assert torch.equal(bits(compiled_bank), bits(eager_bank)), "the bank after the compiled snapshot writes"
    assert torch.equal(bits(compiled_bank[K + 1]), bits(t["lr"])) and torch.equal(bits(compiled_bank[K]),
                                                                                   bits(eager_o["as_upd"]))


def test_public_out_under_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    t = _inputs(seed=7)

    def step(lr, add, bank, res_w, rms_w, norm_w, upd, out, q, s):
        return attnres.attn_res_add_rmsnorm(lr, add, bank[:K], res_w, rms_w, norm_w, *EPS, fp8="block128",
                                            snapshot_slot=K, out=(upd, out, q, s))

    def buffers():
        return _rows(), _rows(), _rows(FP8), attnres.fp8.empty_scales("block128", T, H, "cpu")

    w = (t["res_w"], t["rms_w"], t["norm_w"])
    eb, cb = t["bank"].clone(), t["bank"].clone()
    eo, co = buffers(), buffers()
    e = step(t["lr"], t["add"], eb, *w, *eo)
    c = torch.compile(step, fullgraph=True)(t["lr"], t["add"], cb, *w, *co)
    for i, (x, y, given) in enumerate(zip(c, e, co)):
        assert torch.equal(bits(x), bits(y)), i
        assert torch.equal(bits(given), bits(y)), f"compiled out= entry #{i} not written in place"
    assert torch.equal(bits(cb), bits(eb))


# ------------------------------------------------------------------------------------------------ the errors
def test_error_classes():
    assert attnres.ArgumentError.__mro__[1:3] == (attnres.AttnResError, ValueError)
    assert issubclass(attnres.UnsupportedError, attnres.AttnResError)
    assert issubclass(attnres.UnsupportedError, RuntimeError)
    assert issubclass(attnres.CudaError, attnres.AttnResError) and issubclass(attnres.CudaError, RuntimeError)
    assert issubclass(attnres.AttnResError, Exception)
    for cls in (attnres.AttnResError, attnres.ArgumentError, attnres.UnsupportedError, attnres.CudaError):
        assert cls.__module__ == "attnres", cls
        assert getattr(attnres, cls.__name__) is cls
        assert getattr(attnres.errors, cls.__name__) is cls
    assert _C.ArgumentError is attnres.ArgumentError
    for name in ("UnsupportedError", "CudaError"):
        if hasattr(_C, name):
            assert getattr(_C, name) is getattr(attnres, name), name


def _c_error():
    t = _inputs()
    try:  # raised by the C++ library (validation of a wrong-rank layer_residual)
        attnres.attn_res(t["lr"][None, None], t["bank"][:K], t["res_w"], t["rms_w"], EPS[0])
    except attnres.AttnResError as e:
        return e
    raise AssertionError("no error")


def test_library_errors_are_caught_by_the_base_class():
    e = _c_error()
    assert type(e) is attnres.ArgumentError and isinstance(e, ValueError)
    t = _inputs()
    with pytest.raises(attnres.AttnResError) as u:
        attnres.attn_res_add_rmsnorm(t["lr"], t["add"], t["bank"][:K], t["res_w"], t["rms_w"], t["norm_w"], *EPS,
                                     return_mixture=True, options=attnres.Options(topology="persistent"))
    assert type(u.value) is attnres.UnsupportedError
    assert str(u.value).startswith("attn_res_add_rmsnorm: the persistent kernel does not emit the pre-norm mixture tap")


def test_traceback_names_attnres_argument_error():
    e = _c_error()
    line = traceback.format_exception_only(type(e), e)[-1]
    assert line.startswith("attnres.ArgumentError: attn_res: layer_residual must be a 2-D [T, H] tensor"), line
    code = textwrap.dedent("""
        import torch, attnres
        lr = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16); bank = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
        w = torch.ones(64, dtype=torch.bfloat16)
        attnres.attn_res(lr, bank, w, w, 1e-5)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("attnres.ArgumentError: attn_res: layer_residual must be a 2-D [T, H] tensor"), out.stderr


# ------------------------------------------------------------------------------------------------ no backward
def _functional(family, t, lr):
    block = t["bank"][:K]
    w3 = (t["res_w"], t["rms_w"], t["norm_w"])
    if family == "attn_res":
        return torch.ops.attnres.attn_res(lr, block, *w3[:2], EPS[0])[1]
    if family == "attn_res_rmsnorm":
        return torch.ops.attnres.attn_res_rmsnorm(lr, block, *w3, *EPS)[0]
    return torch.ops.attnres.attn_res_add_rmsnorm(lr, t["add"], None, block, *w3, *EPS)[1]


def _public_functional(family, t, lr):
    block = t["bank"][:K]
    w3 = (t["res_w"], t["rms_w"], t["norm_w"])
    if family == "attn_res":
        return attnres.attn_res(lr, block, *w3[:2], EPS[0], diagnostics=False)
    if family == "attn_res_rmsnorm":
        return attnres.attn_res_rmsnorm(lr, block, *w3, *EPS)
    return attnres.attn_res_add_rmsnorm(lr, t["add"], block, *w3, *EPS)[1]


@pytest.mark.parametrize("entry", [_functional, _public_functional], ids=["torch_op", "public"])
@pytest.mark.parametrize("family", ["attn_res", "attn_res_rmsnorm", "attn_res_add_rmsnorm"])
def test_backward_of_a_functional_op_raises_naming_the_op(family, entry):
    t = _inputs(seed=8)
    lr = t["lr"].clone().requires_grad_(True)
    y = entry(family, t, lr)
    assert y.requires_grad
    with torch.no_grad():
        ref = entry(family, t, t["lr"])
    assert torch.equal(bits(y.detach()), bits(ref)), "the forward under grad mode must give the same bits"
    with pytest.raises(attnres.UnsupportedError, match="^" + re.escape(f"{family}: attnres ops are inference ops "
                                                                       "and have no backward")):
        y.float().sum().backward()


WRITES = ("attn_res_add_rmsnorm: writes into caller tensors and does not support automatic differentiation, but an "
          "input requires grad")


def test_out_with_requires_grad_raises_at_call_time():
    t = _inputs(seed=9)
    lr = t["lr"].clone().requires_grad_(True)
    w3 = (t["res_w"], t["rms_w"], t["norm_w"])
    out = (_rows(), _rows())
    with Unchanged(*out, *t.values()), pytest.raises(attnres.ArgumentError, match="^" + re.escape(WRITES)):
        attnres.attn_res_add_rmsnorm(lr, t["add"], t["bank"][:K], *w3, *EPS, out=out)
    with Unchanged(*out, *t.values()), pytest.raises(attnres.ArgumentError, match="^" + re.escape(WRITES)):
        torch.ops.attnres.attn_res_add_rmsnorm.out(lr, t["add"], None, t["bank"][:K], *w3, *EPS, updated=out[0],
                                                   output=out[1])
    bank = t["bank"].clone()
    with Unchanged(bank, *t.values()), pytest.raises(attnres.ArgumentError, match="^" + re.escape(
            "attn_res_add_rmsnorm: writes into caller tensors")):
        attnres.attn_res_add_rmsnorm(lr, t["add"], bank[:K], *w3, *EPS, snapshot_slot=K)
    with Unchanged(bank, *t.values()), pytest.raises(attnres.ArgumentError, match="^" + re.escape(
            "attn_res_rmsnorm: writes into caller tensors")):
        torch.ops.attnres.attn_res_rmsnorm_snapshot(lr, bank, K, K, *w3, *EPS)
    # under no_grad the same calls run
    with torch.no_grad():
        attnres.attn_res_add_rmsnorm(lr, t["add"], t["bank"][:K], *w3, *EPS, out=out)
    assert not out[1].isnan().any()


# ----------------------------------------------------------------------------------- moe_finalize out=
def _moe_inputs(seed=0, R=6, D=64, T=3, k=2):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(R, D, generator=g).to(torch.bfloat16)
    weights = torch.rand(T, k, generator=g)
    index = torch.randint(0, R, (T, k), generator=g).to(torch.int32)
    shared = torch.randn(T, D, generator=g).to(torch.bfloat16)
    return rows, weights, index, shared, torch.ones(D, dtype=torch.bfloat16)


def test_moe_finalize_out_is_returned_and_equals_the_allocating_call():
    rows, weights, index, shared, nw = _moe_inputs()
    want = attnres.moe_finalize(rows, weights, index, shared=shared, norm_weight=nw, eps=1e-5)
    out = torch.full_like(want, float("nan"))
    got = attnres.moe_finalize(rows, weights, index, shared=shared, norm_weight=nw, eps=1e-5, out=out)
    assert got is out
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    out2 = torch.full_like(want, float("nan"))
    torch.ops.attnres.moe_finalize.out(rows, weights, index, shared, nw, 1e-5, 1.0, output=out2)
    assert torch.equal(out2.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("make,message", [
    (lambda rows, shared: torch.empty(3, 72, dtype=torch.bfloat16), "output must have shape [T, D] = [3, 64]"),
    (lambda rows, shared: torch.empty(3, 64), "output must be bfloat16, got float32"),
    (lambda rows, shared: rows[:3], "output overlaps rows"),
    (lambda rows, shared: shared, "output overlaps shared"),
])
def test_moe_finalize_bad_out_is_refused_and_nothing_written(make, message):
    rows, weights, index, shared, nw = _moe_inputs(1)
    out = make(rows, shared)
    before = [t.clone() for t in (rows, shared, out)]
    with pytest.raises(attnres.ArgumentError, match=re.escape(f"moe_finalize: {message}")):
        attnres.moe_finalize(rows, weights, index, shared=shared, norm_weight=nw, eps=1e-5, out=out)
    for b, t in zip(before, (rows, shared, out)):
        assert torch.equal(b.view(torch.uint8), t.view(torch.uint8))


def test_moe_finalize_out_under_compile_equals_eager():
    torch._dynamo.reset()
    rows, weights, index, shared, nw = _moe_inputs(2)
    want = attnres.moe_finalize(rows, weights, index, shared=shared, norm_weight=nw, eps=1e-5)
    out = torch.empty_like(want)

    def step(rows, weights, index, shared, nw, out):
        return attnres.moe_finalize(rows, weights, index, shared=shared, norm_weight=nw, eps=1e-5, out=out) + 0

    got = torch.compile(step, fullgraph=True)(rows, weights, index, shared, nw, out)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("family", ["attn_res", "attn_res_add_rmsnorm"])
def test_in_place_update_bumps_the_version_counter(family):
    """The in-place prefix update is seen by autograd like any in-place op: a graph that saved the prefix
    refuses to backpropagate through the modified value instead of silently using it."""
    g = torch.Generator().manual_seed(11)
    T, K, H = 2, 3, 64
    rnd = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    prefix, delta, bank, w = rnd(T, H), rnd(T, H), rnd(K, T, H), rnd(H)
    scale = torch.ones(T, H, dtype=torch.bfloat16, requires_grad=True)
    saved = scale * prefix  # mul saves prefix for its backward
    version = prefix._version
    if family == "attn_res":
        attnres.attn_res(prefix, bank, w, w, 1e-5, layer_residual_add=delta, diagnostics=False, out=(prefix, None))
    else:
        attnres.attn_res_add_rmsnorm(prefix, delta, bank, w, w, w, 1e-5, 1e-5, out=(prefix, None))
    assert prefix._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.float().sum().backward()
