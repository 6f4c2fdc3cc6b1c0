"""A rejection test for every precondition of cpp/src/validate.cpp (and the Python-level ones of ops.py,
_tensors.py, options.py and the plan's option checks), in the order validate() checks them.

Each test asserts the error type (attnres.ArgumentError, a ValueError, for violated preconditions;
attnres.UnsupportedError for calls the plan declines; ValueError/TypeError raised by the Python layer), the
message naming op, argument and rule, and that the rejected call wrote nothing: every input buffer (padding
and spare bank rows included) and every caller-provided output keeps its bits.

Preconditions that the public functions cannot reach (the outputs they allocate are always well formed)
go through attnres._C.run with hand-built AttnResArgs, as _attn_ops.py builds them. Layout violations
that torch cannot express (negative strides, null pointers) use hand-made TensorRefs over real memory.
CUDA-only rules are tested on a GPU with real tensors, and on every machine through attnres._C.validate with
TensorRefs that claim a CUDA device (validate never dereferences a pointer; nothing is launched).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import attnres
from attnres import _C
from attnres._tensors import ref, stream_of
from conftest import HAS_CUDA, requires_cuda
from helpers import BF16, assert_same_bits, make_inputs, max_cluster_library, max_cluster_python, poison_

OPS = ("attn_res", "attn_res_rmsnorm", "attn_res_add_rmsnorm", "attn_res_add_rmsnorm_persistent")
ROWS_IN = ("layer_residual", "layer_residual_add", "layer_residual_add2")
WEIGHTS = ("res_weight", "rms_weight", "norm_weight")
OP_INPUTS = {
    "attn_res": ("layer_residual", "block_residual", "res_weight", "rms_weight"),
    "attn_res_rmsnorm": ("layer_residual", "block_residual", "res_weight", "rms_weight", "norm_weight"),
    "attn_res_add_rmsnorm": ("layer_residual", "layer_residual_add", "layer_residual_add2", "block_residual",
                             "res_weight", "rms_weight", "norm_weight"),
    "attn_res_add_rmsnorm_persistent": ("layer_residual", "layer_residual_add", "block_residual", "res_weight",
                                        "rms_weight", "norm_weight"),
}
OP_OUTPUTS = {
    "attn_res": ("output", "rsigma", "probs", "logits"),
    "attn_res_rmsnorm": ("output", "mixture"),
    "attn_res_add_rmsnorm": ("updated", "output", "mixture"),
    "attn_res_add_rmsnorm_persistent": ("updated", "output"),
}
T, N, H = 3, 3, 64
K = N - 1
MAX_CLUSTER = max_cluster_python()  # the Options bound; the library's must agree (test_cluster_bounds_agree)


def _inputs(device, **kw):
    kw.setdefault("layout", "token_major")
    return make_inputs(T, N, H, addends=2, seed=kw.pop("seed", 3), device=device, spare_rows=3, **kw)


def _rand(shape, device, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


class Written:
    """Records every tensor a rejected call could have written (the inputs' buffers and any tensor the case
    created) and checks afterwards that none of them changed."""

    def __init__(self, inp):
        self.inp = inp
        self.extra: list[torch.Tensor] = []

    def new(self, t: torch.Tensor) -> torch.Tensor:
        self.extra.append(t)
        return t

    def __enter__(self):
        self.before = self.inp.storage_snapshot()
        self.extra_before = [t.clone() for t in self.extra]
        return self

    def __exit__(self, *exc):
        for name, old in self.before.items():
            assert_same_bits(self.inp.buffers[name], old, f"input buffer {name!r} after a rejected call")
        for i, (t, old) in enumerate(zip(self.extra, self.extra_before)):
            assert_same_bits(t, old, f"tensor #{i} of the case after a rejected call")
        return False


def _rejects(exc, message: str):
    return pytest.raises(exc, match="^" + re.escape(message))


# ------------------------------------------------------------------------------- calling the public functions
def _public(op, inp, **over):
    a = dict(layer_residual=inp.layer_residual, layer_residual_add=inp.add, layer_residual_add2=None,
             block_residual=inp.block_residual, res_weight=inp.res_weight, rms_weight=inp.rms_weight,
             norm_weight=inp.norm_weight, rms_eps=inp.rms_eps, norm_eps=inp.norm_eps, options=None)
    if op == "attn_res_add_rmsnorm":
        a["layer_residual_add2"] = inp.add2
    a.update(over)
    w = (a["res_weight"], a["rms_weight"])
    if op == "attn_res":
        return attnres.attn_res(a["layer_residual"], a["block_residual"], *w, a["rms_eps"], options=a["options"])
    if op == "attn_res_rmsnorm":
        return attnres.attn_res_rmsnorm(a["layer_residual"], a["block_residual"], *w, a["norm_weight"], a["rms_eps"],
                                        a["norm_eps"], return_mixture=a.get("return_mixture", False),
                                        options=a["options"])
    if op == "attn_res_add_rmsnorm":
        return attnres.attn_res_add_rmsnorm(a["layer_residual"], a["layer_residual_add"], a["block_residual"], *w,
                                            a["norm_weight"], a["rms_eps"], a["norm_eps"],
                                            layer_residual_add2=a["layer_residual_add2"],
                                            return_mixture=a.get("return_mixture", False),
                                            snapshot_slot=a.get("snapshot_slot"), options=a["options"])
    return attnres.attn_res_add_rmsnorm_persistent(a["layer_residual"], a["block_residual"], *w, a["norm_weight"],
                                                   a["rms_eps"], a["norm_eps"],
                                                   layer_residual_add=a["layer_residual_add"], options=a["options"])


def _pub(op):
    """The op a public call's message names: attnres.attn_res_add_rmsnorm_persistent is an alias of
    attn_res_add_rmsnorm with Options(topology="persistent") (_public passes it an addend)."""
    return "attn_res_add_rmsnorm" if op == "attn_res_add_rmsnorm_persistent" else op


def _case_value(inp, name):
    return {"layer_residual": inp.layer_residual, "layer_residual_add": inp.add, "layer_residual_add2": inp.add2,
            "block_residual": inp.block_residual, "res_weight": inp.res_weight, "rms_weight": inp.rms_weight,
            "norm_weight": inp.norm_weight}[name]


def _accepted(op, inp, call):
    """Runs an accepted call; where this build declines the persistent kernel on CUDA, the decline (and
    nothing else) must come back."""
    p = attnres.plan(op, tokens=inp.T, candidates=inp.N, hidden=inp.H, device=inp.device,
                     add=op in ("attn_res_add_rmsnorm", "attn_res_add_rmsnorm_persistent"),
                     add2=op == "attn_res_add_rmsnorm", diagnostics=op == "attn_res",
                     options=attnres.Options(topology="persistent") if op == "attn_res_add_rmsnorm_persistent" else None)
    if p.accepted:
        call()
        return
    assert inp.device.type == "cuda" and op == "attn_res_add_rmsnorm_persistent", p.decline
    with pytest.raises(attnres.UnsupportedError, match=re.escape(p.decline)):
        call()


def test_baseline_calls_are_accepted(device):
    """Every rejection below differs from one of these accepted calls in exactly one argument."""
    inp = _inputs(device)
    for op in OPS:
        _accepted(op, inp, lambda: _public(op, inp))
        _accepted(op, inp, lambda: c_run(op, c_tensors(op, inp)))


# --------------------------------------------------------------------------------------- hand-built calls
def c_tensors(op, inp, **over):
    """A valid tensor set for attnres._C.run: the case's inputs and poisoned (NaN) caller-owned outputs."""
    dev = inp.device
    rows = lambda: poison_(torch.empty(T, H, dtype=BF16, device=dev))  # noqa: E731
    diag = lambda: poison_(torch.empty(N, T, dtype=torch.float32, device=dev))  # noqa: E731
    d = {name: _case_value(inp, name) for name in OP_INPUTS[op]}
    for name in OP_OUTPUTS[op]:
        d[name] = diag() if name in ("rsigma", "probs", "logits") else rows()
    d.update(over)
    return d


def c_run(op, d, *, rms_eps=1e-5, norm_eps=1e-5, snapshot_slot=-1, options=None, validate_only=False):
    args = _C.AttnResArgs()
    for name, v in d.items():
        if v is not None:
            setattr(args, name, v if isinstance(v, _C.TensorRef) else ref(v, op, name))
    args.rms_eps, args.norm_eps, args.snapshot_slot = rms_eps, norm_eps, snapshot_slot
    lr = d.get("layer_residual")
    args.stream = stream_of(lr) if isinstance(lr, torch.Tensor) else 0
    opts = options if options is not None else attnres.Options().to_c()
    if validate_only:
        _C.validate(getattr(_C.AttnResOp, op), args)
    else:
        _C.run(getattr(_C.AttnResOp, op), args, opts)


class CWritten(Written):
    """Written, plus every tensor handed to attnres._C.run (outputs included)."""

    def __init__(self, inp, d):
        super().__init__(inp)
        self.extra = [v for v in d.values() if isinstance(v, torch.Tensor)]


def hand_ref(t: torch.Tensor, *, data=None, shape=None, strides=None, device=None, dtype=None) -> _C.TensorRef:
    dev_type = _C.DeviceType.cuda if (device or t.device.type) == "cuda" else _C.DeviceType.cpu
    return _C.TensorRef(t.data_ptr() if data is None else data, dtype or _C.DType.bf16, dev_type, 0,
                        list(t.shape) if shape is None else shape, list(t.stride()) if strides is None else strides)


def _c_reject(op, inp, d, exc, message, **kw):
    with CWritten(inp, d):
        with _rejects(exc, f"{op}: {message}"):
            c_run(op, d, **kw)


# ========================================================================= 1. which arguments the op takes
@pytest.mark.parametrize("op", ["attn_res_add_rmsnorm", "attn_res_add_rmsnorm_persistent"])
def test_add2_without_add(op, device):
    inp = _inputs(device)
    d = c_tensors(op, inp, layer_residual_add=None, layer_residual_add2=inp.add2)
    _c_reject(op, inp, d, attnres.ArgumentError, "layer_residual_add2 requires layer_residual_add")


def test_add2_without_add_public(device):
    inp = _inputs(device)
    with Written(inp), _rejects(attnres.ArgumentError,
                                "attn_res_add_rmsnorm: layer_residual_add2 requires layer_residual_add"):
        _public("attn_res_add_rmsnorm", inp, layer_residual_add=None)


REQUIRED = [(op, name) for op in OPS for name in ("layer_residual", "block_residual", "res_weight", "rms_weight",
                                                  "norm_weight", "output", "updated", "layer_residual_add")
            if name in OP_INPUTS[op] + OP_OUTPUTS[op] and not (op == "attn_res_add_rmsnorm_persistent" and
                                                                name == "layer_residual_add")]


@pytest.mark.parametrize("op,name", REQUIRED)
def test_required_argument_missing(op, name, device):
    inp = _inputs(device)
    d = c_tensors(op, inp, **{name: None})
    if name == "layer_residual_add" and "layer_residual_add2" in d:
        d["layer_residual_add2"] = None  # else the add2-requires-add rule fires first
    _c_reject(op, inp, d, attnres.ArgumentError, f"{name} is required")


def test_required_add_missing_public(device):
    inp = _inputs(device)
    with Written(inp), _rejects(attnres.ArgumentError, "attn_res_add_rmsnorm: layer_residual_add is required"):
        _public("attn_res_add_rmsnorm", inp, layer_residual_add=None, layer_residual_add2=None)


REFUSED = [
    ("attn_res", "norm_weight"), ("attn_res", "mixture"),
    ("attn_res_rmsnorm", "layer_residual_add"), ("attn_res_rmsnorm", "updated"), ("attn_res_rmsnorm", "rsigma"),
    ("attn_res_rmsnorm", "probs"), ("attn_res_rmsnorm", "logits"),
    ("attn_res_add_rmsnorm", "rsigma"), ("attn_res_add_rmsnorm", "probs"), ("attn_res_add_rmsnorm", "logits"),
    ("attn_res_add_rmsnorm_persistent", "layer_residual_add2"), ("attn_res_add_rmsnorm_persistent", "mixture"),
    ("attn_res_add_rmsnorm_persistent", "rsigma"),
]


@pytest.mark.parametrize("op,name", REFUSED)
def test_refused_argument(op, name, device):
    inp = _inputs(device)
    extra = {"layer_residual_add": inp.add, "layer_residual_add2": inp.add2, "norm_weight": inp.norm_weight,
             "updated": poison_(torch.empty(T, H, dtype=BF16, device=device)),
             "mixture": poison_(torch.empty(T, H, dtype=BF16, device=device))}
    value = extra.get(name, poison_(torch.empty(N, T, dtype=torch.float32, device=device)))
    d = c_tensors(op, inp, **{name: value})
    _c_reject(op, inp, d, attnres.ArgumentError, f"{name} is not an argument of this op")


@pytest.mark.parametrize("op", ["attn_res", "attn_res_add_rmsnorm_persistent"])  # the add is optional there
def test_updated_without_add(op, device):
    inp = _inputs(device)
    d = c_tensors(op, inp, layer_residual_add=None,
                  updated=poison_(torch.empty(T, H, dtype=BF16, device=device)))
    _c_reject(op, inp, d, attnres.ArgumentError, "updated is only produced with layer_residual_add")


def test_attn_res_add_without_updated(device):
    op = "attn_res"
    inp = _inputs(device)
    d = c_tensors(op, inp, layer_residual_add=inp.add, updated=None)
    _c_reject(op, inp, d, attnres.ArgumentError, "updated is required")


@pytest.mark.parametrize("op", ["attn_res_add_rmsnorm_persistent"])  # every other op takes it
def test_snapshot_slot_refused(op, device):
    inp = _inputs(device)
    _c_reject(op, inp, c_tensors(op, inp), attnres.ArgumentError, "snapshot_slot is not an argument of this op",
              snapshot_slot=K)


# ============================================================================ 2. ranks, sizes and shapes
def _shape_cases():
    cases = []
    for op in OPS:
        cases += [
            (op, "layer_residual", lambda d: _rand((T, 2, H), d), "layer_residual must be a 2-D [T, H] tensor, "
             f"got 3 dimensions [{T}, 2, {H}]"),
            (op, "layer_residual", lambda d: _rand((T * H,), d), "layer_residual must be a 2-D [T, H] tensor, "
             f"got 1 dimensions [{T * H}]"),
            (op, "block_residual", lambda d: _rand((T, H), d), "block_residual must be a 3-D [K, T, H] tensor, "
             f"got 2 dimensions [{T}, {H}]"),
            (op, "block_residual", lambda d: _rand((K, T + 1, H), d),
             f"block_residual must have shape [K, T, H] = [*, {T}, {H}], got [{K}, {T + 1}, {H}]"),
            (op, "block_residual", lambda d: _rand((K, T, H + 8), d),
             f"block_residual must have shape [K, T, H] = [*, {T}, {H}], got [{K}, {T}, {H + 8}]"),
            (op, "block_residual", lambda d: _rand((16, T, H), d),
             "block_residual holds K = 16 snapshots: N = K + 1 must be in [1, 16]"),
            (op, "block_residual", lambda d: _rand((40, T, H), d),
             "block_residual holds K = 40 snapshots: N = K + 1 must be in [1, 16]"),
        ]
        for w in WEIGHTS:
            if w not in OP_INPUTS[op]:
                continue
            cases += [
                (op, w, lambda d: _rand((H - 8,), d), f"{w} must have shape [H] = [{H}], got [{H - 8}]"),
                (op, w, lambda d: _rand((H + 8,), d), f"{w} must have shape [H] = [{H}], got [{H + 8}]"),
                (op, w, lambda d: _rand((1, H - 8), d), f"{w} must have shape [1, H] = [1, {H}], got [1, {H - 8}]"),
                (op, w, lambda d: _rand((2, H), d), f"{w} must be a 1-D [H] tensor, got 2 dimensions [2, {H}]"),
                (op, w, lambda d: _rand((H, 1), d), f"{w} must be a 1-D [H] tensor, got 2 dimensions [{H}, 1]"),
            ]
        for a in ("layer_residual_add", "layer_residual_add2"):
            if a not in OP_INPUTS[op]:
                continue
            cases += [
                (op, a, lambda d: _rand((T, H + 8), d), f"{a} must have shape [T, H] = [{T}, {H}], got [{T}, {H + 8}]"),
                (op, a, lambda d: _rand((T + 1, H), d), f"{a} must have shape [T, H] = [{T}, {H}], got [{T + 1}, {H}]"),
                (op, a, lambda d: _rand((T * H,), d), f"{a} must be a 2-D [T, H] tensor, got 1 dimensions [{T * H}]"),
            ]
    return cases


SHAPE_CASES = _shape_cases()


@pytest.mark.parametrize("op,name,make,message", SHAPE_CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(SHAPE_CASES)])
def test_wrong_shape(op, name, make, message, device):
    inp = _inputs(device)
    w = Written(inp)
    bad = w.new(make(device))
    with w, _rejects(attnres.ArgumentError, f"{_pub(op)}: {message}"):
        _public(op, inp, **{name: bad})


@pytest.mark.parametrize("op", OPS)
def test_zero_tokens(op, device):
    inp = _inputs(device)
    w = Written(inp)
    lr, add, bank = w.new(_rand((0, H), device)), w.new(_rand((0, H), device)), w.new(_rand((K, 0, H), device))
    with w, _rejects(attnres.ArgumentError, f"{_pub(op)}: layer_residual must hold T >= 1 tokens, got shape [0, {H}]"):
        _public(op, inp, layer_residual=lr, layer_residual_add=add, layer_residual_add2=add if
                op == "attn_res_add_rmsnorm" else None, block_residual=bank)


@pytest.mark.parametrize("hidden", [0, 4, 60, 68, 16392, 16384 + 64])
@pytest.mark.parametrize("op", OPS)
def test_hidden_size_out_of_range(op, hidden, device):
    inp = _inputs(device)
    w = Written(inp)
    lr, add = w.new(_rand((T, hidden), device)), w.new(_rand((T, hidden), device))
    bank = w.new(_rand((K, T, hidden), device))
    wt = w.new(_rand((hidden,), device))
    with w, _rejects(attnres.ArgumentError,
                     f"{_pub(op)}: layer_residual hidden size H = {hidden} must be a multiple of 8 in [8, 16384]"):
        _public(op, inp, layer_residual=lr, layer_residual_add=add, layer_residual_add2=add if
                op == "attn_res_add_rmsnorm" else None, block_residual=bank, res_weight=wt, rms_weight=wt,
                norm_weight=wt)


def test_largest_supported_sizes_are_accepted(device):
    """The edges of the range: H = 8 and H = 16384, N = 16."""
    for hidden in (8, 16384):
        inp = make_inputs(2, 16, hidden, addends=2, seed=hidden, device=device)
        for op in OPS:
            _accepted(op, inp, lambda: _public(op, inp))


OUTPUT_SHAPES = [
    ("attn_res", "output", (T, H + 8), BF16, f"output must have shape [T, H] = [{T}, {H}], got [{T}, {H + 8}]"),
    ("attn_res", "output", (T * H,), BF16, f"output must be a 2-D [T, H] tensor, got 1 dimensions [{T * H}]"),
    ("attn_res", "rsigma", (N + 1, T), torch.float32, f"rsigma must have shape [N, T] = [{N}, {T}], got [{N + 1}, {T}]"),
    ("attn_res", "probs", (N, T + 1), torch.float32, f"probs must have shape [N, T] = [{N}, {T}], got [{N}, {T + 1}]"),
    ("attn_res", "logits", (N * T,), torch.float32, f"logits must be a 2-D [N, T] tensor, got 1 dimensions [{N * T}]"),
    ("attn_res_rmsnorm", "mixture", (T + 1, H), BF16, f"mixture must have shape [T, H] = [{T}, {H}], got [{T + 1}, {H}]"),
    ("attn_res_add_rmsnorm", "updated", (T, H - 8), BF16,
     f"updated must have shape [T, H] = [{T}, {H}], got [{T}, {H - 8}]"),
    ("attn_res_add_rmsnorm_persistent", "output", (1, T, H), BF16,
     f"output must be a 2-D [T, H] tensor, got 3 dimensions [1, {T}, {H}]"),
]


@pytest.mark.parametrize("op,name,shape,dtype,message", OUTPUT_SHAPES)
def test_output_wrong_shape(op, name, shape, dtype, message, device):
    inp = _inputs(device)
    d = c_tensors(op, inp, **{name: poison_(torch.empty(shape, dtype=dtype, device=device))})
    _c_reject(op, inp, d, attnres.ArgumentError, message)


# ===================================================================================================== 3. dtypes
DTYPE_CASES = [(op, name, dt) for op in OPS for name in OP_INPUTS[op] for dt in (torch.float32,)] + [
    ("attn_res_add_rmsnorm", "layer_residual", torch.float16), ("attn_res", "block_residual", torch.float16),
    ("attn_res_rmsnorm", "norm_weight", torch.float64), ("attn_res", "res_weight", torch.int32),
    ("attn_res", "rms_weight", torch.complex64), ("attn_res", "layer_residual", torch.bool),
    ("attn_res_rmsnorm", "res_weight", torch.int16), ("attn_res_add_rmsnorm", "block_residual", torch.uint32),
]
DTYPE_NAMES = {BF16: "bfloat16", torch.float32: "float32", torch.float16: "float16", torch.float64: "float64", torch.int32: "int32",
               torch.complex64: "complex64", torch.bool: "bool", torch.int16: "int16", torch.uint32: "uint32"}


@pytest.mark.parametrize("op,name,dtype", DTYPE_CASES, ids=[f"{o}-{n}-{d}" for o, n, d in DTYPE_CASES])
def test_input_wrong_dtype(op, name, dtype, device):
    inp = _inputs(device)
    w = Written(inp)
    bad = w.new(_case_value(inp, name).to(dtype) if dtype not in (torch.int32, torch.int16, torch.uint32) else
                torch.randint(1, 9, _case_value(inp, name).shape, dtype=dtype, device=device))
    with w, _rejects(attnres.ArgumentError, f"{_pub(op)}: {name} must be bfloat16, got {DTYPE_NAMES[dtype]}"):
        _public(op, inp, **{name: bad})


@pytest.mark.parametrize("op,name,dtype,want", [
    ("attn_res", "output", torch.float32, "bfloat16"), ("attn_res", "rsigma", BF16, "float32"),
    ("attn_res", "probs", torch.float64, "float32"), ("attn_res", "logits", torch.float16, "float32"),
    ("attn_res_rmsnorm", "mixture", torch.float32, "bfloat16"), ("attn_res_add_rmsnorm", "updated", torch.float16,
                                                                  "bfloat16"),
    ("attn_res_add_rmsnorm_persistent", "output", torch.float32, "bfloat16")])
def test_output_wrong_dtype(op, name, dtype, want, device):
    inp = _inputs(device)
    shape = (N, T) if name in ("rsigma", "probs", "logits") else (T, H)
    d = c_tensors(op, inp, **{name: poison_(torch.empty(shape, dtype=dtype, device=device))})
    _c_reject(op, inp, d, attnres.ArgumentError, f"{name} must be {want}, got {DTYPE_NAMES[dtype]}")


# ==================================================================================================== 4. devices
@pytest.mark.parametrize("op", OPS)
def test_claimed_cuda_tensor_with_cpu_prefix(op):
    """A TensorRef on another device than layer_residual (validate only: the CUDA claim is never used)."""
    inp = _inputs("cpu")
    for name in OP_INPUTS[op][1:] + OP_OUTPUTS[op]:
        d = c_tensors(op, inp)
        d[name] = hand_ref(d[name], device="cuda", dtype=_C.DType.f32 if name in ("rsigma", "probs", "logits")
                           else _C.DType.bf16)
        with CWritten(inp, d), _rejects(attnres.ArgumentError, f"{op}: {name} is on cuda:0 but layer_residual is "
                                        "on cpu (all tensors must be on one device)"):
            c_run(op, d, validate_only=True)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_cpu_and_cuda_mixed(op):
    for name in OP_INPUTS[op]:
        inp = _inputs("cuda")
        w = Written(inp)
        moved = w.new(_case_value(inp, name).cpu())
        if name == "layer_residual":
            other = OP_INPUTS[op][1]
            message = f"{_pub(op)}: {other} is on cuda:0 but layer_residual is on cpu (all tensors must be on one device)"
        else:
            message = f"{_pub(op)}: {name} is on cpu but layer_residual is on cuda:0 (all tensors must be on one device)"
        with w, _rejects(attnres.ArgumentError, message):
            _public(op, inp, **{name: moved})
            torch.cuda.synchronize()


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.gpu
def test_two_cuda_devices_mixed():
    inp = _inputs("cuda:0")
    w = Written(inp)
    bank = w.new(inp.block_residual.to("cuda:1"))
    with w, _rejects(attnres.ArgumentError, "attn_res: block_residual is on cuda:1 but layer_residual is on cuda:0"):
        _public("attn_res", inp, block_residual=bank)


@pytest.mark.parametrize("op", OPS)
def test_unsupported_device_type_mixed_with_cpu(op):
    """A meta tensor next to CPU tensors must be rejected by the Python layer, not computed (or faked)."""
    inp = _inputs("cpu")
    w = Written(inp)
    meta = inp.block_residual.to("meta")
    with w, _rejects(ValueError, f"{_pub(op)}: block_residual is on meta: only cpu and cuda tensors are supported"):
        _public(op, inp, block_residual=meta)


def test_non_tensor_argument():
    inp = _inputs("cpu")
    with Written(inp), _rejects(TypeError, "attn_res: block_residual must be a torch.Tensor or a DLPack producer, "
                                "got list"):
        _public("attn_res", inp, block_residual=[[1.0]])


def test_rank_beyond_tensor_ref_limit(device):
    """A rank-5 tensor cannot even be described to the library; the message still names op and argument."""
    inp = _inputs(device)
    w = Written(inp)
    bad = w.new(_rand((1, 1, 1, T, H), device))
    with w, _rejects(attnres.ArgumentError, "attn_res_rmsnorm: layer_residual has rank 5: the library takes tensors "
                                            "of rank <= 4"):
        _public("attn_res_rmsnorm", inp, layer_residual=bad)


# ==================================================================================================== 5. layouts
def _inner_strided(x: torch.Tensor) -> torch.Tensor:
    """The same shape with innermost stride 2 (every other element of a twice-as-wide buffer)."""
    buf = torch.repeat_interleave(x, 2, dim=-1).contiguous()
    return buf[..., ::2]


@pytest.mark.parametrize("op,name", [(op, n) for op in OPS for n in OP_INPUTS[op]])
def test_non_unit_innermost_stride(op, name, device):
    inp = _inputs(device)
    w = Written(inp)
    bad = w.new(_inner_strided(_case_value(inp, name)))
    strides = ", ".join(str(s) for s in bad.stride())
    with w, _rejects(attnres.ArgumentError,
                     f"{_pub(op)}: {name} must have a contiguous last dimension (stride 1), got strides [{strides}]"):
        _public(op, inp, **{name: bad})


@pytest.mark.parametrize("op,name", [(op, n) for op in OPS for n in OP_INPUTS[op] if n not in WEIGHTS])
def test_overlapping_token_rows(op, name, device):
    """expand() over the token dimension: every token would read one row (stride 0)."""
    inp = _inputs(device)
    x = _case_value(inp, name)
    bad = x[:, :1].expand(x.shape) if name == "block_residual" else x[:1].expand(x.shape)
    shape = ", ".join(str(s) for s in bad.shape)
    strides = ", ".join(str(s) for s in bad.stride())
    with Written(inp), _rejects(attnres.ArgumentError,
                                f"{_pub(op)}: {name} has an overlapping layout (shape [{shape}], strides [{strides}]): "
                                "every element must have its own address"):
        _public(op, inp, **{name: bad})


def test_overlapping_snapshot_rows_of_the_bank(device):
    """A bank whose snapshot stride is smaller than a row: two snapshots would share elements."""
    inp = _inputs(device)
    buf = inp.bank_buffer
    bad = buf.as_strided((K, T, H), (H // 2, buf.shape[1] * H, 1))  # token-major buffer [T, Kmax, H]
    with Written(inp), _rejects(attnres.ArgumentError,
                                f"attn_res: block_residual has an overlapping layout (shape [{K}, {T}, {H}], strides "
                                f"[{H // 2}, {buf.shape[1] * H}, 1])"):
        _public("attn_res", inp, block_residual=bad)


@pytest.mark.parametrize("op,name", [(op, n) for op in OPS for n in OP_INPUTS[op]])
def test_negative_stride(op, name, device):
    inp = _inputs(device)
    d = c_tensors(op, inp)
    x = d[name]
    if x.dim() == 1:
        d[name] = hand_ref(x, data=x[-1:].data_ptr(), strides=[-1])
        message = f"{name} has a negative stride [-1]"
    else:  # the last row first, walking backwards over the leading dimension
        last = x[-1:] if x.dim() == 2 else x[-1:]
        strides = [-x.stride(0)] + list(x.stride()[1:])
        d[name] = hand_ref(x, data=last.data_ptr(), strides=strides)
        message = f"{name} has a negative stride [{', '.join(str(s) for s in strides)}]"
    _c_reject(op, inp, d, attnres.ArgumentError, message)


@pytest.mark.parametrize("op,name", [(op, n) for op in OPS for n in OP_INPUTS[op] + OP_OUTPUTS[op]])
def test_null_data_pointer(op, name, device):
    inp = _inputs(device)
    d = c_tensors(op, inp)
    dtype = _C.DType.f32 if name in ("rsigma", "probs", "logits") else _C.DType.bf16
    d[name] = hand_ref(d[name], data=0, dtype=dtype)
    _c_reject(op, inp, d, attnres.ArgumentError, f"{name} has a null data pointer")


def test_output_layout_rules_apply_to_outputs(device):
    op = "attn_res_add_rmsnorm"
    inp = _inputs(device)
    wide = poison_(torch.empty(T, 2 * H, dtype=BF16, device=device))
    d = c_tensors(op, inp, output=wide[:, ::2])
    _c_reject(op, inp, d, attnres.ArgumentError,
              f"output must have a contiguous last dimension (stride 1), got strides [{2 * H}, 2]")
    row = poison_(torch.empty(1, H, dtype=BF16, device=device))
    d = c_tensors(op, inp, updated=row.expand(T, H))
    _c_reject(op, inp, d, attnres.ArgumentError, f"updated has an overlapping layout (shape [{T}, {H}], strides [0, 1])")


# ===================================================================================================== 6. scalars
BAD_EPS = [float("nan"), float("inf"), float("-inf"), -1e-5]


@pytest.mark.parametrize("eps", BAD_EPS, ids=["nan", "inf", "-inf", "negative"])
@pytest.mark.parametrize("op", OPS)
def test_bad_rms_eps(op, eps, device):
    inp = _inputs(device)
    with Written(inp), _rejects(attnres.ArgumentError, f"{_pub(op)}: rms_eps must be finite and >= 0, got "):
        _public(op, inp, rms_eps=eps)


@pytest.mark.parametrize("eps", BAD_EPS, ids=["nan", "inf", "-inf", "negative"])
@pytest.mark.parametrize("op", OPS[1:])
def test_bad_norm_eps(op, eps, device):
    inp = _inputs(device)
    with Written(inp), _rejects(attnres.ArgumentError, f"{_pub(op)}: norm_eps must be finite and >= 0, got "):
        _public(op, inp, norm_eps=eps)


def test_attn_res_ignores_norm_eps(device):
    """norm_eps is not an argument of attn_res (no trailing norm), so its value is not judged."""
    inp = _inputs(device)
    c_run("attn_res", c_tensors("attn_res", inp), norm_eps=math.nan)


# ================================================================================================ 7. snapshot row
def test_snapshot_slot_negative_python(device):
    inp = _inputs(device)
    with Written(inp), _rejects(attnres.ArgumentError, "attn_res_add_rmsnorm: snapshot_slot must be None or a row index >= K, "
                                "got -1"):
        _public("attn_res_add_rmsnorm", inp, snapshot_slot=-1)


@pytest.mark.parametrize("slot", [-2, -100])
def test_snapshot_slot_negative_library(slot, device):
    op = "attn_res_add_rmsnorm"
    inp = _inputs(device)
    _c_reject(op, inp, c_tensors(op, inp), attnres.ArgumentError,
              f"snapshot_slot must be -1 (no snapshot) or a row index >= K, got {slot}", snapshot_slot=slot)


@pytest.mark.parametrize("slot", [0, K - 1])
def test_snapshot_slot_is_a_candidate(slot, device):
    inp = _inputs(device)
    with Written(inp), _rejects(attnres.ArgumentError, f"attn_res_add_rmsnorm: snapshot_slot {slot} is a candidate "
                                f"of this call (must be >= K = {K})"):
        _public("attn_res_add_rmsnorm", inp, snapshot_slot=slot)


@pytest.mark.parametrize("layout", ["contiguous", "snapshot_major", "token_major"])
def test_snapshot_slot_outside_storage(layout, device):
    inp = _inputs(device, layout=layout)
    rows = {"contiguous": K, "snapshot_major": K + 3, "token_major": K + 3}[layout]
    with Written(inp), _rejects(ValueError, f"attn_res_add_rmsnorm: snapshot_slot {rows} lies outside "
                                "block_residual's storage"):
        _public("attn_res_add_rmsnorm", inp, snapshot_slot=rows)


def test_snapshot_slot_out_of_range(device):
    op = "attn_res_add_rmsnorm"
    inp = _inputs(device)
    _c_reject(op, inp, c_tensors(op, inp), attnres.ArgumentError, "snapshot_slot is out of range",
              snapshot_slot=(1 << 30) + 1)


def test_snapshot_slot_without_bank_pointer(device):
    op = "attn_res_add_rmsnorm"
    inp = _inputs(device)
    empty = torch.empty(0, T, H, dtype=BF16, device=device)
    d = c_tensors(op, inp, block_residual=hand_ref(empty, data=0))
    _c_reject(op, inp, d, attnres.ArgumentError, "snapshot_slot needs a block_residual data pointer",
              snapshot_slot=0)


def test_snapshot_row_overlapping_candidates(device):
    """Token-major bank with Kmax rows per token: slot Kmax is the next token's row 0 (a candidate)."""
    inp = _inputs(device, layout="token_major")
    kmax = inp.bank_buffer.shape[1]
    w = Written(inp)
    big = w.new(_rand((T + 1, kmax, H), device, seed=5))
    bank = big[:T].transpose(0, 1)[:K]
    with w, _rejects(attnres.ArgumentError, f"attn_res_add_rmsnorm: snapshot_slot {kmax} would overlap the candidate "
                     f"rows of block_residual (strides [{H}, {kmax * H}, 1])"):
        _public("attn_res_add_rmsnorm", inp, block_residual=bank, snapshot_slot=kmax)


# ================================================================================================== 8. aliasing
ALIASES = [
    ("attn_res", "output", "layer_residual", "output overlaps layer_residual (outputs must not alias inputs)"),
    ("attn_res_rmsnorm", "output", "block_residual", "output overlaps block_residual (outputs must not alias inputs)"),
    ("attn_res_add_rmsnorm", "mixture", "layer_residual",
     "mixture overlaps layer_residual (outputs must not alias inputs)"),
    ("attn_res_add_rmsnorm", "updated", "layer_residual_add",
     "updated overlaps layer_residual_add (outputs must not alias inputs)"),
    ("attn_res_add_rmsnorm", "output", "layer_residual_add2",
     "output overlaps layer_residual_add2 (outputs must not alias inputs)"),
    ("attn_res_add_rmsnorm", "mixture", "output", "mixture overlaps output (outputs must not alias each other)"),
    # outputs are compared in the order output, updated, mixture, rsigma, probs, logits: the later one is named
    ("attn_res_add_rmsnorm", "output", "updated", "updated overlaps output (outputs must not alias each other)"),
    ("attn_res_add_rmsnorm_persistent", "output", "layer_residual_add",
     "output overlaps layer_residual_add (outputs must not alias inputs)"),
    ("attn_res", "probs", "rsigma", "probs overlaps rsigma (outputs must not alias each other)"),
    ("attn_res", "logits", "probs", "logits overlaps probs (outputs must not alias each other)"),
]


@pytest.mark.parametrize("op,out,onto,message", ALIASES)
def test_output_aliases(op, out, onto, message, device):
    inp = _inputs(device)
    d = c_tensors(op, inp)
    target = d[onto]
    if onto == "block_residual":
        target = inp.bank_buffer[:, 0] if inp.layout == "token_major" else inp.bank_buffer[0]
    d[out] = target  # the output written over an input (or another output)
    _c_reject(op, inp, d, attnres.ArgumentError, message)


def test_output_partially_overlapping_an_input(device):
    """A one-row shift is enough: outputs may not touch any byte an input can read."""
    op = "attn_res_add_rmsnorm"
    inp = _inputs(device)
    big = poison_(torch.empty(T + 1, H, dtype=BF16, device=device))
    lr = big[:T].copy_(inp.layer_residual)
    d = c_tensors(op, inp, layer_residual=lr, updated=big[1:])
    _c_reject(op, inp, d, attnres.ArgumentError, "updated overlaps layer_residual (outputs must not alias inputs)")


@pytest.mark.parametrize("op", ["attn_res_add_rmsnorm", "attn_res_add_rmsnorm_persistent"])
def test_updated_partially_aliasing_the_prefix(op, device):
    """`updated` may be layer_residual itself (the in-place update): the same pointer with other strides is not."""
    inp = _inputs(device)
    wide = poison_(torch.empty(T, 2 * H, dtype=BF16, device=device))
    lr = wide[:, :H].copy_(inp.layer_residual)
    d = c_tensors(op, inp, layer_residual=lr)
    d["updated"] = hand_ref(lr, strides=[H, 1])
    _c_reject(op, inp, d, attnres.ArgumentError, "updated overlaps layer_residual (outputs must not alias inputs)")


def test_snapshot_row_aliasing_the_prefix(device):
    """The prefix living in the very bank row the call is asked to write."""
    inp = _inputs(device, layout="snapshot_major")
    slot = K + 1
    prefix_in_bank = inp.bank_buffer[slot].copy_(inp.layer_residual)
    with Written(inp), _rejects(attnres.ArgumentError, "attn_res_add_rmsnorm: snapshot row overlaps layer_residual "
                                "(outputs must not alias inputs)"):
        _public("attn_res_add_rmsnorm", inp, layer_residual=prefix_in_bank, snapshot_slot=slot)


def test_snapshot_row_aliasing_an_output(device):
    op = "attn_res_add_rmsnorm"
    inp = _inputs(device, layout="snapshot_major")
    slot = K + 1
    d = c_tensors(op, inp, mixture=inp.bank_buffer[slot])
    _c_reject(op, inp, d, attnres.ArgumentError, "snapshot row overlaps mixture (outputs must not alias each other)",
              snapshot_slot=slot)


def test_inputs_may_share_memory(device):
    """Only outputs are checked for aliasing: one tensor serving as several weights is a valid call."""
    inp = _inputs(device)
    _public("attn_res_add_rmsnorm", inp, res_weight=inp.rms_weight, norm_weight=inp.rms_weight,
            layer_residual_add2=inp.add)


# ================================================================================ 9. CUDA layout rules (16 bytes)
def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """The same values in a buffer offset by one element (2 bytes) from a 16-byte boundary."""
    flat = torch.empty(x.numel() + 8, dtype=x.dtype, device=x.device)
    view = flat[1:1 + x.numel()].view(x.shape)
    return view.copy_(x)


def _odd_token_stride(x: torch.Tensor) -> torch.Tensor:
    """The same values with 4 elements of padding after each row: the outer strides are not multiples of 8."""
    buf = torch.empty(*x.shape[:-1], x.shape[-1] + 4, dtype=x.dtype, device=x.device)
    return buf[..., :x.shape[-1]].copy_(x)


ALIGN_MESSAGE = "must be 16-byte aligned for the CUDA kernels (base pointer and outer strides a multiple of 16 bytes)"


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("op,name", [(op, n) for op in OPS for n in OP_INPUTS[op]])
def test_cuda_misaligned_pointer(op, name):
    inp = _inputs("cuda")
    w = Written(inp)
    bad = w.new(_misaligned(_case_value(inp, name)))
    with w, _rejects(attnres.ArgumentError, f"{_pub(op)}: {name} {ALIGN_MESSAGE}"):
        _public(op, inp, **{name: bad})
        torch.cuda.synchronize()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("op,name", [(op, n) for op in OPS for n in OP_INPUTS[op] if n not in WEIGHTS])
def test_cuda_token_stride_not_a_multiple_of_8(op, name):
    inp = _inputs("cuda")
    w = Written(inp)
    bad = w.new(_odd_token_stride(_case_value(inp, name)))
    strides = ", ".join(str(s) for s in bad.stride())
    with w, _rejects(attnres.ArgumentError, f"{_pub(op)}: {name} {ALIGN_MESSAGE}, got strides [{strides}]"):
        _public(op, inp, **{name: bad})
        torch.cuda.synchronize()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("op,name", [(op, n) for op in OPS for n in OP_OUTPUTS[op] if n not in ("rsigma", "probs",
                                                                                                 "logits")])
def test_cuda_misaligned_output(op, name):
    inp = _inputs("cuda")
    d = c_tensors(op, inp)
    d[name] = _misaligned(d[name])
    _c_reject(op, inp, d, attnres.ArgumentError, f"{name} {ALIGN_MESSAGE}")


def _claimed_cuda(d: dict) -> dict:
    """The same call with every tensor described as living on cuda:0 (validate-only: never dereferenced)."""
    out = {}
    for name, v in d.items():
        if isinstance(v, torch.Tensor):
            dtype = _C.DType.f32 if v.dtype == torch.float32 else _C.DType.bf16
            out[name] = hand_ref(v, device="cuda", dtype=dtype)
        else:
            out[name] = v
    return out


@pytest.mark.parametrize("op", OPS)
def test_alignment_rules_on_claimed_cuda_tensors(op):
    """The CUDA-only layout rules, exercised on every machine through validate()."""
    inp = _inputs("cpu")
    c_run(op, _claimed_cuda(c_tensors(op, inp)), validate_only=True)  # the aligned call passes validate
    for name in OP_INPUTS[op] + tuple(n for n in OP_OUTPUTS[op] if n not in ("rsigma", "probs", "logits")):
        for make in (_misaligned, _odd_token_stride):
            if make is _odd_token_stride and name in WEIGHTS:
                continue
            d = c_tensors(op, inp)
            d[name] = make(d[name])
            strides = ", ".join(str(s) for s in d[name].stride())
            claimed = _claimed_cuda(d)
            with CWritten(inp, d), _rejects(attnres.ArgumentError, f"{op}: {name} {ALIGN_MESSAGE}, got strides "
                                            f"[{strides}]"):
                c_run(op, claimed, validate_only=True)


def test_misaligned_snapshot_row_on_claimed_cuda():
    """K = 1: the bank's snapshot stride is unconstrained for the candidates but places row `slot` off a
    16-byte boundary."""
    op = "attn_res_add_rmsnorm"
    inp = make_inputs(T, 2, H, addends=1, seed=1, device="cpu")
    buf = torch.empty(3 * T * H + 64, dtype=BF16)
    stride0 = T * H + 4  # 8 bytes past a row boundary
    bank = buf.as_strided((1, T, H), (stride0, H, 1))
    d = c_tensors(op, inp, block_residual=bank, layer_residual_add2=None)
    c_run(op, _claimed_cuda(d), validate_only=True)  # without the snapshot write the bank is fine
    with CWritten(inp, d), _rejects(attnres.ArgumentError, f"{op}: snapshot row {ALIGN_MESSAGE}"):
        c_run(op, _claimed_cuda(d), snapshot_slot=1, validate_only=True)


def test_cpu_accepts_unaligned_views_and_reads_them_through_their_strides():
    """On the CPU the same views are valid and give the bits of the dense call."""
    inp = _inputs("cpu")
    dense = _public("attn_res_add_rmsnorm", inp, return_mixture=True)
    views = {"layer_residual": _misaligned(inp.layer_residual), "layer_residual_add": _odd_token_stride(inp.add),
             "layer_residual_add2": _misaligned(inp.add2), "block_residual": _odd_token_stride(inp.block_residual),
             "res_weight": _misaligned(inp.res_weight), "norm_weight": _misaligned(inp.norm_weight)}
    strided = _public("attn_res_add_rmsnorm", inp, return_mixture=True, **views)
    for name, a, b in zip(("updated", "output", "mixture"), strided, dense):
        assert_same_bits(a, b, f"{name} from unaligned/padded views vs dense")


# =============================================================================================== options, declines
@pytest.mark.parametrize("kwargs,message", [
    ({"topology": "ring"}, "Options.topology must be one of"),
    ({"kernel": "fast"}, "Options.kernel must be one of"),
    ({"split_max_tokens": -1}, "Options.split_max_tokens must be an int >= 0, got -1"),
    ({"split_max_tokens": 1.5}, "Options.split_max_tokens must be an int >= 0, got 1.5"),
    ({"cluster": MAX_CLUSTER + 1}, f"Options.cluster must be an int in [0, {MAX_CLUSTER}], got {MAX_CLUSTER + 1}"),
    ({"cluster": -1}, f"Options.cluster must be an int in [0, {MAX_CLUSTER}], got -1"),
    ({"pdl": "yes"}, "Options.pdl must be a bool, got 'yes'"),
])
def test_options_validation(kwargs, message):
    with _rejects(ValueError, message):
        attnres.Options(**kwargs)


def test_cluster_bounds_agree():
    """Options (Python) and the plan (C++) accept the same cluster sizes; 8 is the portable cluster limit."""
    assert MAX_CLUSTER == max_cluster_library()
    assert 1 <= MAX_CLUSTER <= 16


@pytest.mark.parametrize("field,value,message", [
    ("split_max_tokens", -1, "options.split_max_tokens must be >= 0"),
    ("cluster", MAX_CLUSTER + 1, f"options.cluster must be in [0, {MAX_CLUSTER}], got {MAX_CLUSTER + 1}"),
    ("cluster", -2, f"options.cluster must be in [0, {MAX_CLUSTER}], got -2"),
])
def test_library_options_validation(field, value, message, device):
    """The C++ plan checks the options it gets from any caller (the Python dataclass is one of them)."""
    for op in OPS:
        inp = _inputs(device)
        opts = attnres.Options().to_c()
        setattr(opts, field, value)
        _c_reject(op, inp, c_tensors(op, inp), attnres.ArgumentError, message, options=opts)


def test_plan_argument_errors():
    with _rejects(ValueError, "attnres.plan: op must be one of"):
        attnres.plan("attn_res_fast", tokens=1, candidates=2, hidden=64)
    with _rejects(ValueError, "attnres.plan: device meta is not supported (cpu, cuda, h100, h200 or a property dict)"):
        attnres.plan("attn_res", tokens=1, candidates=2, hidden=64, device="meta")


@pytest.mark.parametrize("options", [attnres.Options(topology="persistent"), attnres.Options(kernel="persistent"),
                                     attnres.Options(topology="split", split_max_tokens=T - 1)],
                         ids=["topology_persistent", "kernel_persistent", "split_above_ceiling"])
def test_persistent_routes_take_two_addends(options, device):
    """The persistent route streams the second addend as one more row: the call runs (on the CPU the topologies
    keep the cpu kernel; forcing the persistent kernel there is the device's decline) with the default's bits."""
    inp = _inputs(device)
    if device == "cpu" and options.kernel == "persistent":
        with Written(inp), _rejects(attnres.UnsupportedError,
                                         "attn_res_add_rmsnorm: kernel persistent runs on CUDA devices"):
            _public("attn_res_add_rmsnorm", inp, options=options)
        return
    want = [t.clone() for t in _public("attn_res_add_rmsnorm", inp)]
    got = _public("attn_res_add_rmsnorm", inp, options=options)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_split_topology_at_the_ceiling_takes_the_per_token_path(device):
    inp = _inputs(device)
    _public("attn_res_add_rmsnorm", inp, options=attnres.Options(topology="split", split_max_tokens=T))


def test_persistent_declines_the_tap(device):
    inp = _inputs(device)
    opts = attnres.Options(topology="persistent")
    with Written(inp), _rejects(attnres.UnsupportedError, "attn_res_add_rmsnorm: the persistent kernel does not emit "
                                "the pre-norm mixture tap"):
        _public("attn_res_add_rmsnorm", inp, layer_residual_add2=None, return_mixture=True, options=opts)
    with Written(inp), _rejects(attnres.UnsupportedError, "attn_res_rmsnorm: the persistent kernel does not emit "
                                "the pre-norm mixture tap"):
        _public("attn_res_rmsnorm", inp, return_mixture=True, options=opts)


@pytest.mark.parametrize("kernel", ["single_cta", "split_k", "persistent"])
@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_declined_on_cpu(op, kernel):
    inp = _inputs("cpu")
    why = ("the persistent kernel does not emit the fp32 diagnostics: attn_res with diagnostics runs on the "
           "per-token kernels"
           if (op, kernel) == ("attn_res", "persistent") else f"kernel {kernel} runs on CUDA devices; the tensors "
           "are on cpu")
    with Written(inp), _rejects(attnres.UnsupportedError, f"{_pub(op)}: {why}"):
        _public(op, inp, layer_residual_add2=None, options=attnres.Options(kernel=kernel))


@requires_cuda
@pytest.mark.gpu
def test_cpu_kernel_declined_on_cuda():
    inp = _inputs("cuda")
    with Written(inp), _rejects(attnres.UnsupportedError, "attn_res: kernel cpu runs on CPU tensors; the tensors "
                                "are on cuda:0"):
        _public("attn_res", inp, options=attnres.Options(kernel="cpu"))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,hidden", [(9, 7168), (16, 256), (2, 8200), (4, 16384)])
def test_single_cta_declines_beyond_its_registers(n, hidden):
    inp = make_inputs(2, n, hidden, addends=1, seed=n, device="cuda")
    before = inp.storage_snapshot()
    with pytest.raises(attnres.UnsupportedError, match=r"^attn_res_add_rmsnorm: single_cta holds a token's rows in one "
                       r"block's registers: it needs H <= 8192 and N <= \d+ \(use split_k\)$"):
        attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, inp.res_weight, inp.rms_weight,
                                     inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                     options=attnres.Options(kernel="single_cta"))
    for name, old in before.items():
        assert_same_bits(inp.buffers[name], old, name)


@requires_cuda
@pytest.mark.gpu
def test_split_k_declines_a_cluster_too_small_for_h():
    inp = make_inputs(2, 9, 7168, addends=1, seed=2, device="cuda")
    with _rejects(attnres.UnsupportedError, "attn_res_add_rmsnorm: split_k with a cluster of 1 needs 896 threads per "
                  "block for H = 7168"):
        attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, inp.res_weight, inp.rms_weight,
                                     inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                     options=attnres.Options(kernel="split_k", cluster=1))
