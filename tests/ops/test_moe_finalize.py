"""moe_finalize (docs/ops/moe_finalize.md): accuracy against the float64 oracle, the bitwise properties of the
combine, the reconstruction identity, determinism, rejections (nothing written), the gate and the dispatching
helper's fallback, the custom op's fake implementation and torch.compile.

Inputs are fresh per case (seeded by the case), never zeros; rows the index map does not name — padding rows,
and the rows remote routes would have had — hold NaN, so a kernel that reads one fails every check.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import attnres
from attnres import _C, knobs, moe
from attnres._tensors import ref
from attnres.models.moe_producer import ToyRoutedMoE
from attnres.reference import check_close
from conftest import HAS_CUDA, requires_cuda

BF16 = torch.bfloat16
F32 = torch.float32
NAN = float("nan")


# ------------------------------------------------------------------------------------------------- inputs
@dataclass
class Case:
    rows: Tensor
    weights: Tensor
    index: Tensor
    shared: Tensor | None
    norm_weight: Tensor | None
    eps: float
    scale: float
    storage: dict  # every buffer the views live in (padding included)

    def kwargs(self) -> dict:
        return {"shared": self.shared, "norm_weight": self.norm_weight, "eps": self.eps, "scale": self.scale}

    def snapshot(self) -> dict:
        return {k: v.clone() for k, v in self.storage.items()}

    def assert_unchanged(self, before: dict) -> None:
        for name, old in before.items():
            assert_same_bits(self.storage[name], old, f"input storage {name!r}")


def make_case(T: int, k: int, D: int, *, seed: int, device="cpu", weights_dtype=F32, shared=False, norm=False,
              scale=1.0, eps=1e-5, remote=0.2, spare_rows=8, row_pad=0, magnitude=(0.05, 20.0)) -> Case:
    """Every route names a distinct row of a permuted [R, D] buffer (R = T * k + spare_rows); a fraction
    `remote` of the routes is -1. Only named rows hold data: the rest, and row_pad columns, are NaN."""
    g = torch.Generator().manual_seed(seed)
    R = T * k + spare_rows
    storage = torch.full((R, D + row_pad), NAN, dtype=BF16)
    perm = torch.randperm(R, generator=g)[:T * k].reshape(T, k)
    is_remote = torch.rand((T, k), generator=g) < remote
    index = torch.where(is_remote, -1, perm).to(torch.int32)
    lo, hi = math.log(magnitude[0]), math.log(magnitude[1])
    mags = torch.exp(torch.empty(T * k, 1, dtype=torch.float64).uniform_(lo, hi, generator=g))
    values = torch.randn(T * k, D, generator=g, dtype=torch.float64) * mags
    named = index.reshape(-1) >= 0
    storage[index.reshape(-1)[named].long(), :D] = values[named].to(BF16)
    weights = torch.softmax(torch.randn(T, k, generator=g), dim=-1).to(weights_dtype)
    sh = (torch.randn(T, D, generator=g) * 0.5).to(BF16) if shared else None
    nw = (1 + 0.1 * torch.randn(D, generator=g)).to(BF16) if norm else None
    bufs = {"rows": storage, "weights": weights, "index": index}
    if sh is not None:
        bufs["shared"] = sh
    if nw is not None:
        bufs["norm_weight"] = nw
    bufs = {name: t.to(device) for name, t in bufs.items()}
    return Case(rows=bufs["rows"][:, :D], weights=bufs["weights"], index=bufs["index"], shared=bufs.get("shared"),
                norm_weight=bufs.get("norm_weight"), eps=eps, scale=scale, storage=bufs)


def bits(t: Tensor) -> Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(actual: Tensor, expected: Tensor, what: str) -> None:
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = bits(actual), bits(expected)
    if not torch.equal(a, e):
        diff = a != e
        first = diff.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first at {first}: "
                             f"{actual.detach().cpu()[tuple(first)].item()!r} vs {expected.detach().cpu()[tuple(first)].item()!r}")


def emulate(c: Case, *, exact_norm: bool) -> Tensor:
    """The CPU backend's arithmetic in PyTorch fp32 ops on the CPU (no FMA in PyTorch's elementwise kernels):
    per route a product then a sum, j ascending, one rounding; the shared add; with exact_norm the norm with
    the backend's sum of squares (8 lanes over the row in order, joined by a fixed tree)."""
    rows, w, idx = c.rows.cpu(), c.weights.cpu(), c.index.cpu().long()
    T, k = idx.shape
    D = rows.shape[1]
    acc = torch.zeros(T, D, dtype=F32)
    for j in range(k):
        valid = (idx[:, j] >= 0).unsqueeze(-1)
        term = rows[idx[:, j].clamp(min=0)].float() * w[:, j:j + 1].float()
        acc = torch.where(valid, acc + term, acc)
    x = (acc * torch.tensor(c.scale, dtype=F32)).to(BF16)
    if c.shared is not None:
        x = x + c.shared.cpu()
    if c.norm_weight is None:
        return x
    assert exact_norm
    xf = x.float()
    lanes = torch.zeros(T, 8, dtype=F32)
    for d in range(0, D, 8):
        lanes = lanes + xf[:, d:d + 8] * xf[:, d:d + 8]
    ss = ((lanes[:, 0] + lanes[:, 1]) + (lanes[:, 2] + lanes[:, 3])) + ((lanes[:, 4] + lanes[:, 5]) + (lanes[:, 6] + lanes[:, 7]))
    r = 1.0 / torch.sqrt(ss / torch.tensor(float(D), dtype=F32) + torch.tensor(c.eps, dtype=F32))
    normed = (xf * r.unsqueeze(-1)).to(BF16)
    return (normed.float() * c.norm_weight.cpu().float()).to(BF16)


def oracle(c: Case) -> Tensor:
    return moe.reference_moe_finalize(c.rows, c.weights, c.index, **c.kwargs())


def run(c: Case, **extra) -> Tensor:
    return attnres.moe_finalize(c.rows, c.weights, c.index, **c.kwargs(), **extra)


# ------------------------------------------------------------------------------------------ accuracy grid
# (T, k, D, weights dtype, shared, norm, scale, eps, remote fraction, row_pad). A covering set: every T in
# {1, 2, 4, 8, 16, 33}, k in {1, 8, 16, 32}, D in {8, 200 (an odd multiple of 8), 3584, 7168}, both weight
# dtypes, shared and norm on/off, scale != 1 each appear several times; the last four exercise the CUDA
# geometry boundaries (1, 2 and 4 vectors per thread) and D = 16384.
CASES = [
    (1, 1, 8, F32, False, False, 1.0, 1e-5, 0.0, 0),
    (1, 8, 3584, F32, True, True, 2.5, 1e-5, 0.2, 0),
    (1, 16, 3584, BF16, True, True, 2.827, 1e-5, 0.25, 0),  # Kimi K3's latent finalize
    (2, 16, 7168, F32, False, True, 1.0, 1e-2, 0.1, 8),
    (2, 32, 200, BF16, True, False, 0.5, 1e-5, 0.3, 0),
    (4, 1, 7168, BF16, False, False, -1.5, 1e-5, 0.0, 0),
    (4, 32, 3584, F32, True, True, 1.0, 0.0, 0.5, 16),
    (8, 8, 200, F32, True, True, 3.0, 1e-5, 0.2, 0),
    (8, 16, 8, BF16, False, True, 1.0, 1e-5, 0.2, 8),
    (16, 16, 3584, F32, True, True, 2.827, 1e-5, 0.2, 0),
    (16, 32, 7168, BF16, True, False, 1.0, 1e-5, 0.1, 0),
    (16, 1, 200, F32, True, True, 1.0, 1e-5, 0.0, 0),
    (33, 8, 7168, F32, True, True, 0.75, 1e-6, 0.2, 0),
    (33, 32, 3584, BF16, False, False, 1.0, 1e-5, 0.3, 0),
    (33, 16, 200, F32, False, True, 1.0, 1e-5, 0.2, 24),
    (3, 4, 4096, F32, True, False, 1.0, 1e-5, 0.1, 0),
    (5, 4, 4104, BF16, True, True, 1.0, 1e-5, 0.1, 0),
    (2, 8, 8192, BF16, True, True, 1.0, 1e-5, 0.1, 0),
    (1, 32, 16384, F32, True, True, 1.0, 1e-5, 0.1, 0),
]


def case_id(c) -> str:
    T, k, D, wd, sh, nm, scale, eps, remote, pad = c
    return (f"T{T}-k{k}-D{D}-w{'f32' if wd == F32 else 'bf16'}{'-shared' if sh else ''}{'-norm' if nm else ''}"
            f"-s{scale:g}-eps{eps:g}-r{remote:g}{f'-pad{pad}' if pad else ''}")


def build(c, device) -> Case:
    T, k, D, wd, sh, nm, scale, eps, remote, pad = c
    return make_case(T, k, D, seed=zlib.crc32(case_id(c).encode()), device=device, weights_dtype=wd, shared=sh,
                     norm=nm, scale=scale, eps=eps, remote=remote, row_pad=pad)


@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_matches_oracle_and_writes_nothing_else(c, device):
    case = build(c, device)
    before = case.snapshot()
    out = run(case)
    assert out.dtype == BF16 and out.device.type == torch.device(device).type
    check_close(out, oracle(case), f"moe_finalize {case_id(c)}")
    case.assert_unchanged(before)
    # Without the norm the result is pinned bit for bit (the combine and the shared add are exact fp32
    # sequences on every backend); with it, the CPU backend's reduction order is pinned too.
    if case.norm_weight is None or torch.device(device).type == "cpu":
        assert_same_bits(out, emulate(case, exact_norm=True), f"moe_finalize {case_id(c)} vs fp32 emulation")


def test_emulation_check_distinguishes_bf16_accumulation():
    """The bitwise check has teeth: rounding after every route (the seed's bf16 accumulation) is caught."""
    case = make_case(4, 16, 3584, seed=11)
    out = run(case)
    rows, w, idx = case.rows, case.weights, case.index.long()
    acc = torch.zeros(4, 3584, dtype=BF16)
    for j in range(16):
        valid = (idx[:, j] >= 0).unsqueeze(-1)
        acc = torch.where(valid, acc + (rows[idx[:, j].clamp(min=0)].float() * w[:, j:j + 1]).to(BF16), acc)
    assert not torch.equal(bits(acc), bits(out))
    with pytest.raises(AssertionError):
        assert_same_bits(acc, emulate(case, exact_norm=True), "bf16 accumulation")


def test_norm_uses_two_roundings_and_eps(device):
    """The CPU bitwise check pins the two-rounding order and where eps enters: one rounding, or eps added
    after the square root, gives different bits."""
    case = make_case(8, 8, 200, seed=5, device=device, shared=True, norm=True, eps=1e-2)
    out = run(case)
    x = emulate(dataclasses.replace(case, norm_weight=None), exact_norm=False).float()
    w = case.norm_weight.cpu().float()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + case.eps)
    one_rounding = (x * r * w).to(BF16)
    eps_outside = ((x / (x.pow(2).mean(-1, keepdim=True).sqrt() + case.eps)).to(BF16).float() * w).to(BF16)
    check_close(out, oracle(case), "two-rounding norm")
    assert not torch.equal(bits(out), bits(one_rounding))
    assert not torch.equal(bits(out), bits(eps_outside))


# --------------------------------------------------------------------------------- reconstruction identity
@pytest.mark.parametrize("weights_dtype", [F32, BF16], ids=["f32", "bf16"])
def test_reconstruction_identity(weights_dtype, device):
    """Gathering rows[index[:, j]], weighting by weights[:, j], summing over j in float64 and rounding once
    reproduces routed within the op tolerance, and routed equals the runner stand-in's own finalize."""
    moe_layer = ToyRoutedMoE(256, 12, 6, seed=3, device=device, routed_scale=2.5, local_experts=range(0, 12, 2),
                             weights_dtype=weights_dtype)
    x = (torch.randn(5, 256, generator=torch.Generator().manual_seed(4)) * 2).to(BF16).to(device)
    pieces = moe_layer(x, do_finalize=False)
    assert bool((pieces.index == -1).any()) and bool((pieces.index >= 0).any())
    routed = attnres.moe_finalize(pieces.rows, pieces.weights, pieces.index, eps=1e-5, scale=pieces.scale)

    rows64, idx = pieces.rows.cpu().double(), pieces.index.cpu().long()
    acc = torch.zeros(5, 256, dtype=torch.float64)
    for j in range(idx.shape[1]):
        valid = (idx[:, j] >= 0).unsqueeze(-1)
        acc += torch.where(valid, rows64[idx[:, j].clamp(min=0)] * pieces.weights.cpu().double()[:, j:j + 1], 0.0)
    check_close(routed, (acc * pieces.scale).to(BF16), "reconstruction in float64")
    assert_same_bits(routed, moe_layer(x), "routed vs the runner's own finalize")


# ------------------------------------------------------------------------------------ determinism, edges
def test_deterministic_and_independent_of_batch_position(device):
    case = make_case(16, 16, 3584, seed=21, device=device, shared=True, norm=True, scale=1.25)
    first = run(case)
    for _ in range(3):
        assert_same_bits(run(case), first, "repeat call")
    for t in (0, 7, 15):
        alone = attnres.moe_finalize(case.rows, case.weights[t:t + 1], case.index[t:t + 1],
                                     shared=case.shared[t:t + 1], norm_weight=case.norm_weight, eps=case.eps,
                                     scale=case.scale)
        assert_same_bits(alone[0], first[t], f"token {t} alone vs in the batch")


def test_all_remote_token_and_empty_rows(device):
    """A token whose routes are all remote sums to +0: out = shared exactly; rows may then be empty."""
    case = make_case(3, 4, 64, seed=8, device=device, shared=True, remote=0.0)
    case.index[1] = -1
    out = run(case)
    assert_same_bits(out[1], case.shared[1], "all-remote token")
    empty = torch.empty((0, 64), dtype=BF16, device=device)
    idx = torch.full((2, 4), -1, dtype=torch.int32, device=device)
    out = attnres.moe_finalize(empty, case.weights[:2], idx, shared=case.shared[:2], eps=1e-5)
    assert_same_bits(out, case.shared[:2], "no local rows at all")


def test_remote_routes_never_read_their_rows(device):
    """-1 skips the route: NaN weights or NaN rows behind a remote route do not leak in (a zero weight would
    not do: 0 * NaN = NaN)."""
    case = make_case(4, 8, 64, seed=9, device=device, remote=0.0)
    expected = run(case)
    case.index[:, 3] = -1
    case.weights[:, 3] = NAN
    out = run(case)
    assert torch.isfinite(out.float()).all()
    check_close(out, oracle(case), "remote routes skipped")
    assert not torch.equal(bits(out), bits(expected))


def test_subnormals_survive_flush_to_zero_mode():
    """Products and sums in the subnormal range are kept even when the process runs with FTZ/DAZ set."""
    g = torch.Generator().manual_seed(13)
    T, k, D = 2, 4, 64
    rows = (torch.randint(1, 100, (T * k, D), generator=g).double() * 2.0 ** -133).to(BF16)  # bf16 subnormals
    weights = torch.rand((T, k), generator=g) + 0.5
    index = torch.arange(T * k, dtype=torch.int32).reshape(T, k)
    shared = (torch.randint(-50, 50, (T, D), generator=g).double() * 2.0 ** -133).to(BF16)
    c = Case(rows, weights, index, shared, None, 1e-5, 0.75, {})
    expected = emulate(c, exact_norm=False)
    assert int(((expected.float() != 0) & (expected.float().abs() < torch.finfo(BF16).smallest_normal)).sum()) > 0
    assert torch.set_flush_denormal(True), "x86 and aarch64 CPUs have a flush-to-zero mode"
    try:
        out = run(c)
        flushed = emulate(c, exact_norm=False)  # PyTorch itself under FTZ: the test can tell the difference
    finally:
        torch.set_flush_denormal(False)
    assert not torch.equal(bits(flushed), bits(expected))
    assert_same_bits(out, expected, "subnormal combine under FTZ")


# ------------------------------------------------------------------------------------------------ rejections
def raw_args(rows, weights, index, *, shared=None, norm_weight=None, eps=1e-5, scale=1.0, output=None):
    a = _C.MoeFinalizeArgs()
    for name, t in (("rows", rows), ("weights", weights), ("index", index), ("shared", shared),
                    ("norm_weight", norm_weight), ("output", output)):
        setattr(a, name, t if isinstance(t, _C.TensorRef) else ref(t, "moe_finalize", name))
    a.eps, a.scale = eps, scale
    return a


def fake_ref(t: Tensor, *, device_type=None, offset_bytes=0, shape=None, strides=None, dtype=None) -> _C.TensorRef:
    """A TensorRef over t's storage with edited metadata (what a C++ caller could pass)."""
    return _C.TensorRef(t.data_ptr() + offset_bytes, _dtype(t.dtype) if dtype is None else dtype,
                        device_type or _C.DeviceType.cpu, 0, list(shape or t.shape), list(strides or t.stride()))


def _dtype(dt):
    return {BF16: _C.DType.bf16, F32: _C.DType.f32, torch.int32: _C.DType.i32}[dt]


def _valid(device="cpu", **kw) -> Case:
    return make_case(3, 4, 64, seed=31, device=device, shared=True, norm=True, **kw)


def sub(**changes):
    """A rule's arguments: those of a valid case with `changes` applied (a callable change gets the case)."""
    def f(c: Case):
        args = dict(rows=c.rows, weights=c.weights, index=c.index, **c.kwargs())
        args.update({k: (v(c) if callable(v) else v) for k, v in changes.items()})
        return args
    return f


# (id, function of a valid case -> (rows, weights, index, kwargs), expected message)
def _public_rejections():
    return [
        ("flat_index", sub(index=lambda c: c.index.reshape(-1)),
         "moe_finalize: index must be a 2-D [T, k] tensor, got a flat map of shape [12] (reshape it to [T, k])"),
        ("index_3d", sub(index=lambda c: c.index.reshape(3, 2, 2)), "moe_finalize: index must be a 2-D [T, k] tensor, got 3 dimensions"),
        ("index_int64", sub(index=lambda c: c.index.long()), "moe_finalize: index must be int32, got int64"),
        ("no_tokens", sub(index=lambda c: c.index[:0], weights=lambda c: c.weights[:0], shared=None),
         "moe_finalize: index holds T = 0 tokens"),
        ("k_too_large", sub(index=lambda c: torch.full((3, 33), -1, dtype=torch.int32, device=c.index.device),
                            weights=lambda c: torch.rand(3, 33, device=c.index.device)),
         "moe_finalize: index holds k = 33 routes per token: k must be in [1, 32]"),
        ("too_many_tokens", sub(index=lambda c: torch.full((16385, 1), -1, dtype=torch.int32, device=c.index.device),
                                weights=lambda c: torch.rand(16385, 1, device=c.index.device), shared=None),
         "moe_finalize: index holds T = 16385 tokens: T must be in [1, 16384]"),
        ("weights_wrong_k", sub(weights=lambda c: torch.rand(3, 5, device=c.rows.device)),
         "moe_finalize: weights must have the shape of index [T, k] = [3, 4], got [3, 5]"),
        ("weights_transposed", sub(weights=lambda c: c.weights.t().contiguous()),
         "moe_finalize: weights must have the shape of index [T, k] = [3, 4], got [4, 3]"),
        ("weights_flat", sub(weights=lambda c: c.weights.reshape(-1)),
         "moe_finalize: weights must have the shape of index [T, k] = [3, 4], got [12]"),
        ("weights_f16", sub(weights=lambda c: c.weights.half()), "moe_finalize: weights must be float32 or bfloat16, got float16"),
        ("weights_int", sub(weights=lambda c: c.index), "moe_finalize: weights must be float32 or bfloat16, got int32"),
        ("weights_padded", sub(weights=lambda c: torch.cat([c.weights, c.weights], 1)[:, :4]),
         "moe_finalize: weights must be dense [T, k] (strides [k, 1] = [4, 1]), got strides [8, 1]"),
        ("weights_column_major", sub(weights=lambda c: c.weights.t().contiguous().t()),
         "moe_finalize: weights must be dense [T, k] (strides [k, 1] = [4, 1]), got strides [1, 3]"),
        ("index_sliced", sub(index=lambda c: torch.cat([c.index, c.index], 1)[:, 4:]),
         "moe_finalize: index must be dense [T, k] (strides [k, 1] = [4, 1]), got strides [8, 1]"),
        ("rows_1d", sub(rows=lambda c: c.rows[0]), "moe_finalize: rows must be a 2-D [R, D] tensor, got 1 dimensions"),
        ("rows_f32", sub(rows=lambda c: c.rows.float()), "moe_finalize: rows must be bfloat16, got float32"),
        ("hidden_not_multiple_of_8", sub(rows=lambda c: c.rows[:, :60].contiguous(), shared=None, norm_weight=None),
         "moe_finalize: rows hidden size D = 60 must be a multiple of 8 in [8, 16384]"),
        ("hidden_too_large", sub(rows=lambda c: torch.zeros(1, 16392, dtype=BF16, device=c.rows.device),
                                 index=lambda c: torch.full((3, 4), -1, dtype=torch.int32, device=c.rows.device),
                                 shared=None, norm_weight=None),
         "moe_finalize: rows hidden size D = 16392 must be a multiple of 8 in [8, 16384]"),
        ("rows_strided_columns", sub(rows=lambda c: torch.cat([c.rows, c.rows], 1)[:, ::2]),
         "moe_finalize: rows must have a contiguous last dimension (stride 1), got strides [128, 2]"),
        ("rows_row_stride_not_multiple_of_8", sub(rows=lambda c: torch.cat([c.rows, c.rows[:, :4]], 1)[:, :64]),
         "moe_finalize: rows row stride 68 must be a multiple of 8 elements (16 bytes)"),
        ("rows_overlapping", sub(rows=lambda c: c.rows.as_strided((c.rows.shape[0], 64), (8, 1))),
         "moe_finalize: rows has an overlapping layout"),
        ("shared_wrong_shape", sub(shared=lambda c: c.shared[:2]), "moe_finalize: shared must have shape [T, D] = [3, 64], got [2, 64]"),
        ("shared_f32", sub(shared=lambda c: c.shared.float()), "moe_finalize: shared must be bfloat16, got float32"),
        ("shared_strided_columns", sub(shared=lambda c: torch.cat([c.shared, c.shared], 1)[:, ::2]),
         "moe_finalize: shared must have a contiguous last dimension (stride 1)"),
        ("norm_weight_wrong_size", sub(norm_weight=lambda c: torch.ones(72, dtype=BF16, device=c.rows.device)),
         "moe_finalize: norm_weight must have shape [D] = [64], got [72]"),
        ("norm_weight_2d", sub(norm_weight=lambda c: c.norm_weight.reshape(1, 64)),
         "moe_finalize: norm_weight must be a 1-D [D] tensor, got 2 dimensions [1, 64]"),
        ("norm_weight_f32", sub(norm_weight=lambda c: c.norm_weight.float()), "moe_finalize: norm_weight must be bfloat16, got float32"),
        ("eps_nan", sub(eps=NAN), "moe_finalize: eps must be finite and >= 0, got nan"),
        ("eps_inf", sub(eps=math.inf), "moe_finalize: eps must be finite and >= 0, got inf"),
        ("eps_negative", sub(eps=-1e-6), "moe_finalize: eps must be finite and >= 0, got -1e-06"),
        ("scale_nan", sub(scale=NAN), "moe_finalize: scale must be finite, got nan"),
        ("scale_inf", sub(scale=-math.inf), "moe_finalize: scale must be finite, got -inf"),
    ]


PUBLIC_REJECTIONS = _public_rejections()
OUT_OF_RANGE = [
    ("index_equal_R", lambda c: c.rows.shape[0], "value {v} at [1, 2] is out of range"),
    ("index_minus_2", lambda c: -2, "value -2 at [1, 2] is out of range"),
    ("index_huge", lambda c: 2 ** 31 - 1, "value 2147483647 at [1, 2] is out of range"),
]


@pytest.mark.parametrize("rule", PUBLIC_REJECTIONS, ids=[r[0] for r in PUBLIC_REJECTIONS])
def test_rejections_public(rule, device):
    _, mutate, message = rule
    case = _valid(device)
    args = mutate(case)
    before = case.snapshot()
    with pytest.raises(attnres.ArgumentError) as err:
        attnres.moe_finalize(**args)
    assert str(err.value).startswith(message), str(err.value)
    case.assert_unchanged(before)


def test_unknown_kernel(device):
    """The Python-level option check: a ValueError before the library is called."""
    case = _valid(device)
    before = case.snapshot()
    with pytest.raises(ValueError) as err:
        run(case, kernel="fast")
    assert str(err.value).startswith("moe_finalize: kernel must be one of ('auto', 'cpu', 'single_cta'), "
                                     "got 'fast'"), str(err.value)
    case.assert_unchanged(before)


@pytest.mark.parametrize("rule", OUT_OF_RANGE, ids=[r[0] for r in OUT_OF_RANGE])
def test_out_of_range_index(rule, device):
    """CPU: rejected by the library's scan. CUDA: the kernel writes NaN for exactly that token (a scan would
    need a host round trip); check_index=True raises the CPU's message on both."""
    _, value, message = rule
    case = _valid(device)
    good = run(case)
    v = value(case)
    case.index[1, 2] = v
    before = case.snapshot()
    expected = "moe_finalize: index " + message.format(v=v)
    with pytest.raises(attnres.ArgumentError, match=r"^" + expected.replace("[", r"\[").replace("]", r"\]")):
        run(case, check_index=True)
    case.assert_unchanged(before)
    if torch.device(device).type == "cpu":
        with pytest.raises(attnres.ArgumentError) as err:
            run(case)
        assert str(err.value).startswith(expected)
    else:
        out = run(case)
        assert torch.isnan(out[1].float()).all()
        assert_same_bits(out[[0, 2]], good[[0, 2]], "the other tokens")
    case.assert_unchanged(before)


def _raw_rejections():
    """Rejections only a C++ caller (or the raw binding) can provoke: output arguments, null and misaligned
    pointers, negative strides, devices that differ, CUDA alignment (validated without launching). Each rule
    builds its arguments from (case, poisoned output, keep): tensors appended to `keep` outlive the call."""
    cuda = _C.DeviceType.cuda

    def cuda_ref(t, **kw):
        return fake_ref(t, device_type=cuda, **kw)

    def held(keep, t):
        keep.append(t)
        return t

    def out_over(buffer):  # a [3, 64] bf16 output whose first byte is buffer's first byte
        return fake_ref(buffer, dtype=_C.DType.bf16, shape=[3, 64], strides=[64, 1])

    def weights_in(keep):  # [3, 4] fp32 weights at the start of a 1.6 KB buffer (room for an aliasing output)
        return held(keep, torch.rand(400))[:12].view(3, 4)

    def index_in(keep, c):
        buf = held(keep, torch.full((200,), -1, dtype=torch.int32))
        buf[:12] = c.index.reshape(-1)
        return buf[:12].view(3, 4)

    def norm_in(keep, c):
        buf = held(keep, torch.ones(200, dtype=BF16))
        buf[:64] = c.norm_weight
        return buf[:64]

    def aliasing(arg):  # the output laid over the start of `arg`'s (enlarged) storage
        def build(c, o, keep):
            if arg == "weights":
                t = weights_in(keep)
            elif arg == "index":
                t = index_in(keep, c)
            else:
                t = norm_in(keep, c)
            return raw_args(c.rows, t if arg == "weights" else c.weights, t if arg == "index" else c.index,
                            norm_weight=t if arg == "norm_weight" else None, output=out_over(t))
        return build

    R = 3 * 4 + 8
    return [
        ("missing_rows", lambda c, o, k: raw_args(None, c.weights, c.index, output=o), "moe_finalize: rows is required"),
        ("missing_weights", lambda c, o, k: raw_args(c.rows, None, c.index, output=o), "moe_finalize: weights is required"),
        ("missing_index", lambda c, o, k: raw_args(c.rows, c.weights, None, output=o), "moe_finalize: index is required"),
        ("missing_output", lambda c, o, k: raw_args(c.rows, c.weights, c.index), "moe_finalize: output is required"),
        ("output_wrong_shape", lambda c, o, k: raw_args(c.rows, c.weights, c.index, output=o[:2]),
         "moe_finalize: output must have shape [T, D] = [3, 64], got [2, 64]"),
        ("output_dtype", lambda c, o, k: raw_args(c.rows, c.weights, c.index, output=fake_ref(o, dtype=_C.DType.f16)),
         "moe_finalize: output must be bfloat16, got float16"),
        ("output_strided_columns", lambda c, o, k: raw_args(
            c.rows, c.weights, c.index, output=fake_ref(held(k, torch.full((3, 128), NAN, dtype=BF16)), shape=[3, 64], strides=[128, 2])),
         "moe_finalize: output must have a contiguous last dimension (stride 1), got strides [128, 2]"),
        ("output_broadcast_rows", lambda c, o, k: raw_args(c.rows, c.weights, c.index, output=fake_ref(o, strides=[0, 1])),
         "moe_finalize: output has an overlapping layout"),
        ("output_aliases_rows", lambda c, o, k: raw_args(c.rows, c.weights, c.index, output=c.rows[:3]),
         "moe_finalize: output overlaps rows (the output must not alias an input)"),
        ("output_aliases_weights", aliasing("weights"),
         "moe_finalize: output overlaps weights (the output must not alias an input)"),
        ("output_aliases_index", aliasing("index"),
         "moe_finalize: output overlaps index (the output must not alias an input)"),
        ("output_aliases_shared", lambda c, o, k: raw_args(c.rows, c.weights, c.index, shared=c.shared, output=c.shared),
         "moe_finalize: output overlaps shared (the output must not alias an input)"),
        ("output_aliases_norm_weight", aliasing("norm_weight"),
         "moe_finalize: output overlaps norm_weight (the output must not alias an input)"),
        ("null_rows", lambda c, o, k: raw_args(_C.TensorRef(0, _C.DType.bf16, _C.DeviceType.cpu, 0, [R, 64], [64, 1]),
                                               c.weights, c.index, output=o), "moe_finalize: rows has a null data pointer"),
        ("null_weights", lambda c, o, k: raw_args(c.rows, _C.TensorRef(0, _C.DType.f32, _C.DeviceType.cpu, 0, [3, 4], [4, 1]),
                                                  c.index, output=o), "moe_finalize: weights has a null data pointer"),
        ("null_index", lambda c, o, k: raw_args(c.rows, c.weights, _C.TensorRef(0, _C.DType.i32, _C.DeviceType.cpu, 0,
                                                                                [3, 4], [4, 1]), output=o),
         "moe_finalize: index has a null data pointer"),
        ("negative_stride", lambda c, o, k: raw_args(fake_ref(c.rows, offset_bytes=128 * (R - 1), strides=[-64, 1]),
                                                     c.weights, c.index, output=o),
         "moe_finalize: rows has a negative stride [-64, 1]"),
        ("weights_misaligned", lambda c, o, k: raw_args(
            c.rows, fake_ref(held(k, torch.rand(16)), offset_bytes=2, shape=[3, 4], strides=[4, 1]), c.index, output=o),
         "moe_finalize: weights data pointer is not aligned to its element size (4 bytes)"),
        ("mixed_devices", lambda c, o, k: raw_args(c.rows, cuda_ref(c.weights), c.index, output=o),
         "moe_finalize: weights is on cuda:0 but rows is on cpu (all tensors must be on one device)"),
        ("output_on_other_device", lambda c, o, k: raw_args(c.rows, c.weights, c.index, output=cuda_ref(o)),
         "moe_finalize: output is on cuda:0 but rows is on cpu (all tensors must be on one device)"),
        ("cuda_rows_offset_by_one", lambda c, o, k: raw_args(
            cuda_ref(c.rows, offset_bytes=2), cuda_ref(c.weights), cuda_ref(c.index), output=cuda_ref(o)),
         "moe_finalize: rows must be 16-byte aligned for the CUDA kernels"),
        ("cuda_shared_offset_by_one", lambda c, o, k: raw_args(
            cuda_ref(c.rows), cuda_ref(c.weights), cuda_ref(c.index),
            shared=cuda_ref(held(k, torch.zeros(3 * 64 + 8, dtype=BF16)), offset_bytes=2, shape=[3, 64], strides=[64, 1]),
            output=cuda_ref(o)),
         "moe_finalize: shared must be 16-byte aligned for the CUDA kernel"),
        ("cuda_output_row_stride", lambda c, o, k: raw_args(
            cuda_ref(c.rows), cuda_ref(c.weights), cuda_ref(c.index),
            output=cuda_ref(held(k, torch.full((3 * 68,), NAN, dtype=BF16)), shape=[3, 64], strides=[68, 1])),
         "moe_finalize: output must be 16-byte aligned for the CUDA kernel"),
        ("cuda_norm_weight_offset", lambda c, o, k: raw_args(
            cuda_ref(c.rows), cuda_ref(c.weights), cuda_ref(c.index),
            norm_weight=cuda_ref(held(k, torch.ones(72, dtype=BF16)), offset_bytes=4, shape=[64], strides=[1]),
            output=cuda_ref(o)),
         "moe_finalize: norm_weight must be 16-byte aligned for the CUDA kernel"),
    ]


RAW_REJECTIONS = _raw_rejections()


@pytest.mark.parametrize("rule", RAW_REJECTIONS, ids=[r[0] for r in RAW_REJECTIONS])
def test_rejections_raw(rule):
    """Through the binding with a caller-owned, poisoned output: the message, and not one byte written."""
    _, build_args, message = rule
    case = _valid()
    out = torch.full((3, 64), NAN, dtype=BF16)
    keep: list = []  # tensors some rules create must outlive the call
    args = build_args(case, out, keep)
    before = case.snapshot()
    out_before = out.clone()
    with pytest.raises(attnres.ArgumentError) as err:
        _C.moe_finalize(args, _C.MoeFinalizeOptions())
    assert str(err.value).startswith(message), str(err.value)
    case.assert_unchanged(before)
    assert_same_bits(out, out_before, "poisoned output")


def test_raw_cuda_args_pass_validation_when_aligned():
    """Positive control of the CUDA alignment rules: the same fake-CUDA call, aligned, validates (and only
    the plan declines on a build or machine that cannot run it)."""
    case = _valid()
    out = torch.empty(3, 64, dtype=BF16)
    cuda = _C.DeviceType.cuda
    args = raw_args(fake_ref(case.rows, device_type=cuda), fake_ref(case.weights, device_type=cuda),
                    fake_ref(case.index, device_type=cuda), shared=fake_ref(case.shared, device_type=cuda),
                    norm_weight=fake_ref(case.norm_weight, device_type=cuda), output=fake_ref(out, device_type=cuda))
    _C.moe_finalize_validate(args, True)


def test_cpu_views_offset_by_one_element_work_through_their_strides():
    """On the CPU nothing is read in 16-byte vectors: a rows view starting one element into its storage is
    legal (and read correctly); on CUDA the same view is rejected (test_cuda_rejects_unaligned_views)."""
    case = _valid()
    storage = torch.full((case.rows.shape[0], 72), NAN, dtype=BF16)
    storage[:, 1:65] = case.rows
    shifted = dataclasses.replace(case, rows=storage[:, 1:65])
    assert_same_bits(run(shifted), run(case), "offset view vs contiguous")


# ------------------------------------------------------------------------------------------------- the gate
def test_gate_default_and_override():
    gate = knobs.CURRENT.moe_finalize_max_tokens  # 16 unless the environment sets the knob
    assert moe.supports_fused_moe_finalize(1, 16, 3584)[0] == (gate >= 1)
    ok, why = moe.supports_fused_moe_finalize(3, 16, 3584, max_tokens=2)
    assert not ok and why == "T = 3 is above the token gate (ATTNRES_MOE_FINALIZE_MAX_TOKENS = 2)"
    assert moe.supports_fused_moe_finalize(16, 16, 3584, max_tokens=16) == (True, "")
    ok, why = moe.supports_fused_moe_finalize(1, 16, 3584, max_tokens=0)
    assert not ok and "disabled" in why and "ATTNRES_MOE_FINALIZE_MAX_TOKENS = 0" in why


def test_gate_follows_the_knob(monkeypatch):
    monkeypatch.setattr(knobs, "CURRENT", dataclasses.replace(knobs.CURRENT, moe_finalize_max_tokens=5))
    assert moe.supports_fused_moe_finalize(5, 8, 64) == (True, "")
    assert not moe.supports_fused_moe_finalize(6, 8, 64)[0]
    monkeypatch.setattr(knobs, "CURRENT", dataclasses.replace(knobs.CURRENT, moe_finalize_max_tokens=0))
    assert not moe.supports_fused_moe_finalize(1, 8, 64)[0]


def test_gate_knob_is_read_from_the_environment_at_import():
    code = ("import attnres, torch; from attnres import moe; "
            "print(moe.supports_fused_moe_finalize(7, 8, 64)[0], moe.supports_fused_moe_finalize(8, 8, 64)[1])")
    env = {**os.environ, "ATTNRES_MOE_FINALIZE_MAX_TOKENS": " 7 "}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True T = 8 is above the token gate (ATTNRES_MOE_FINALIZE_MAX_TOKENS = 7)"


@pytest.mark.parametrize("query, reason", [
    ({"world_size": 2}, "world_size = 2: the fused kernel has no all-reduce"),
    ({"dtypes": (torch.float16, F32)}, "rows are float16 (the kernel reads bfloat16)"),
    ({"dtypes": (BF16, torch.float16)}, "weights are float16 (the kernel reads float32 or bfloat16)"),
    ({"hidden": 12}, "D = 12 is not a multiple of 8 in [8, 16384]"),
    ({"hidden": 16392}, "D = 16392 is not a multiple of 8 in [8, 16384]"),
    ({"k": 33}, "k = 33 is outside [1, 32]"),
], ids=["world_size", "rows_f16", "weights_f16", "hidden_12", "hidden_16392", "k_33"])
def test_gate_declines(query, reason):
    args = {"tokens": 1, "k": 16, "hidden": 3584, "dtypes": (BF16, F32), "device": "cpu", "world_size": 1}
    args.update(query)
    ok, why = moe.supports_fused_moe_finalize(**args, max_tokens=16)
    assert not ok and why.startswith(reason), why


def test_gate_accepts_bf16_weights_and_reports_cuda_capability():
    assert moe.supports_fused_moe_finalize(2, 8, 64, (BF16, BF16), max_tokens=16) == (True, "")
    ok, why = moe.supports_fused_moe_finalize(1, 16, 3584, device="cuda", max_tokens=16)
    if HAS_CUDA:
        assert (ok, why) == (True, "")
    else:
        assert not ok and ("without the CUDA backend" in why or "does not exist" in why or "compute capability" in why)


@pytest.mark.parametrize("bad", [{"tokens": 0}, {"k": -1}, {"hidden": 0}, {"world_size": 0}, {"tokens": True}])
def test_gate_rejects_malformed_queries(bad):
    args = {"tokens": 1, "k": 16, "hidden": 3584, **bad}
    with pytest.raises(ValueError, match="must be an int >= 1"):
        moe.supports_fused_moe_finalize(**args)


# ----------------------------------------------------------------------------------- the dispatching helper
def helper(case: Case, **kw) -> Tensor:
    return moe.finalize_moe_output(case.rows, case.weights, case.index, **case.kwargs(), **kw)


def test_helper_inside_the_gate_takes_the_fused_op(device):
    case = make_case(2, 16, 3584, seed=41, device=device, shared=True, norm=True, scale=2.5)
    with moe.record_finalize_decisions() as record:
        out = helper(case, max_tokens=2)
    assert [(d.path, d.reason, d.tokens, d.routes, d.hidden) for d in record] == [("fused", "", 2, 16, 3584)]
    assert moe.last_finalize_decision() == record[0]
    assert_same_bits(out, run(case), "helper (fused) vs moe_finalize")


def test_helper_outside_the_gate_takes_the_unfused_sequence(device):
    case = make_case(3, 16, 3584, seed=42, device=device, shared=True, norm=True, scale=2.5)
    with moe.record_finalize_decisions() as record:
        out = helper(case, max_tokens=2)
        disabled = helper(case, max_tokens=0)
    assert [d.path for d in record] == ["unfused", "unfused"]
    assert record[0].reason == "T = 3 is above the token gate (ATTNRES_MOE_FINALIZE_MAX_TOKENS = 2)"
    assert "disabled" in record[1].reason
    assert_same_bits(out, moe.unfused_moe_finalize(case.rows, case.weights, case.index, **case.kwargs()), "unfused")
    assert_same_bits(disabled, out, "disabled gate")
    check_close(out, oracle(case), "unfused vs oracle")
    check_close(out, run(case), "unfused vs fused")


@pytest.mark.parametrize("layout, reason", [
    ("weights_padded", "weights is not dense [T, k]"),
    ("index_int64", "index is torch.int64 (the kernel reads int32)"),
    ("rows_row_stride", "rows row stride 68 is not a multiple of 8 elements"),
    ("shared_strided", "shared has a non-unit innermost stride"),
])
def test_helper_falls_back_for_layouts_the_kernel_cannot_read(layout, reason, device):
    """ops.md: a view the kernel cannot read takes a slower path or is rejected, never misread. The fused
    op rejects these (test_rejections_public); the helper takes the unfused path, which reads any view."""
    case = make_case(2, 4, 64, seed=43, device=device, shared=True, norm=True)
    expected = run(case)
    if layout == "weights_padded":
        case = dataclasses.replace(case, weights=torch.cat([case.weights, case.weights], 1)[:, :4])
    elif layout == "index_int64":
        case = dataclasses.replace(case, index=case.index.long())
    elif layout == "rows_row_stride":
        case = dataclasses.replace(case, rows=torch.cat([case.rows, case.rows[:, :4]], 1)[:, :64])
    else:  # innermost stride 2
        case = dataclasses.replace(case, shared=torch.stack([case.shared, case.shared], -1)[..., 0])
    with moe.record_finalize_decisions() as record:
        out = helper(case, max_tokens=16)
    assert record[0].path == "unfused" and record[0].reason.startswith(reason), record[0].reason
    check_close(out, expected, f"fallback for {layout}")


def test_helper_fp16_falls_back_and_keeps_the_dtype(device):
    case = make_case(2, 8, 64, seed=44, device=device, shared=True, norm=True)
    half = dataclasses.replace(case, rows=case.rows.half(), shared=case.shared.half(), norm_weight=case.norm_weight.half())
    with moe.record_finalize_decisions() as record:
        out = helper(half, max_tokens=16)
    assert record[0].path == "unfused" and "float16" in record[0].reason
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), run(case).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("gate", [16, 1], ids=["fused_combine", "unfused"])
def test_helper_world_size_all_reduces_between_combine_and_norm(device, gate):
    """Two identical ranks: the all-reduce doubles the partials, then the norm runs on the sum. Inside the
    token gate the combine runs fused (moe_finalize without its norm); above it, unfused; the same result."""
    case = make_case(2, 8, 256, seed=45, device=device, shared=True, norm=True, scale=1.5)
    calls = []

    def all_reduce(x):
        calls.append((x.shape, x.clone()))
        x.mul_(2)

    with moe.record_finalize_decisions() as record:
        out = helper(case, world_size=2, all_reduce=all_reduce, max_tokens=gate)
    assert [c[0] for c in calls] == [torch.Size([2, 256])]
    if gate == 16:
        assert record[0].path == "fused_combine" and record[0].world_size == 2, record[0]
        assert record[0].reason == "world_size = 2: the fused combine without the norm, then all_reduce, then the norm"
        # The all-reduced partial is exactly the fused op's combine (+ shared), without its norm.
        kernel = moe.moe_finalize(case.rows, case.weights, case.index, shared=case.shared, eps=case.eps,
                                  scale=case.scale)
        assert torch.equal(calls[0][1], kernel)
    else:
        assert record[0].path == "unfused" and "T = 2 is above the token gate" in record[0].reason, record[0]
    partial = moe.reference_moe_finalize(case.rows, case.weights, case.index, shared=case.shared, eps=case.eps,
                                         scale=case.scale)
    from attnres.reference import two_rounding_rmsnorm
    check_close(out, two_rounding_rmsnorm((partial.double() * 2).to(BF16), case.norm_weight.cpu(), case.eps), "TP tail")
    with pytest.raises(ValueError, match="world_size = 2 needs all_reduce"):
        helper(case, world_size=2, max_tokens=gate)


@pytest.mark.parametrize("rule", [r for r in PUBLIC_REJECTIONS if r[0] in (
    "flat_index", "index_3d", "no_tokens", "weights_wrong_k", "weights_transposed", "weights_flat", "weights_int",
    "rows_1d", "shared_wrong_shape", "norm_weight_wrong_size", "norm_weight_2d", "eps_nan", "eps_inf",
    "eps_negative", "scale_nan", "scale_inf")], ids=lambda r: r[0])
@pytest.mark.parametrize("max_tokens", [16, 0], ids=["gate_open", "gate_closed"])
def test_helper_raises_malformed_inputs_on_both_paths(rule, max_tokens, device):
    _, mutate, message = rule
    args = mutate(_valid(device))
    with moe.record_finalize_decisions() as record, pytest.raises(attnres.ArgumentError) as helper_err:
        moe.finalize_moe_output(**args, max_tokens=max_tokens)
    with pytest.raises(attnres.ArgumentError) as op_err:
        attnres.moe_finalize(**args)
    assert str(helper_err.value).startswith(message), str(helper_err.value)
    assert str(op_err.value).startswith(message), str(op_err.value)
    assert record == []  # nothing was decided: the call raised first


# The helper's own well-formedness rules: its unfused path reads dtypes and shapes the fused op rejects with
# other messages (PUBLIC_REJECTIONS), so it checks these itself, before choosing a path.
HELPER_REJECTIONS = [
    ("no_routes", sub(index=lambda c: c.index[:, :0], weights=lambda c: c.weights[:, :0]),
     "moe_finalize: index holds k = 0 routes per token: k must be >= 1 (the fused op: in [1, 32])"),
    ("rows_int16", sub(rows=lambda c: c.rows.to(torch.int16)),
     "moe_finalize: rows must hold D >= 1 floating-point columns, got int16 [20, 64]"),
    ("shared_f32", sub(shared=lambda c: c.shared.float()),
     "moe_finalize: shared must be bfloat16 (the dtype of rows), got float32"),
    ("norm_weight_f32", sub(norm_weight=lambda c: c.norm_weight.float()),
     "moe_finalize: norm_weight must be bfloat16 (the dtype of rows), got float32"),
]


@pytest.mark.parametrize("rule", HELPER_REJECTIONS, ids=[r[0] for r in HELPER_REJECTIONS])
@pytest.mark.parametrize("max_tokens", [16, 0], ids=["gate_open", "gate_closed"])
def test_helper_rejections_of_its_own(rule, max_tokens, device):
    _, mutate, message = rule
    case = _valid(device)
    args = mutate(case)
    before = case.snapshot()
    with moe.record_finalize_decisions() as record, pytest.raises(attnres.ArgumentError) as err:
        moe.finalize_moe_output(**args, max_tokens=max_tokens)
    assert str(err.value).startswith(message), str(err.value)
    assert record == []  # raised before any decision
    case.assert_unchanged(before)


@pytest.mark.parametrize("max_tokens", [16, 0], ids=["gate_open", "gate_closed"])
def test_helper_out_of_range_index_on_both_paths(max_tokens, device):
    """CPU: both paths raise the library's scan message. CUDA: both paths give that token a NaN row."""
    case = _valid(device)
    good = run(case)
    case.index[1, 2] = case.rows.shape[0]
    if torch.device(device).type == "cpu":
        with pytest.raises(attnres.ArgumentError, match=r"^moe_finalize: index value 20 at \[1, 2\] is out of range"):
            helper(case, max_tokens=max_tokens)
    else:
        out = helper(case, max_tokens=max_tokens)
        assert torch.isnan(out[1].float()).all()
        check_close(out[[0, 2]], good[[0, 2]], "the other tokens")


def test_helper_logs_each_distinct_decision_once(caplog):
    case = make_case(3, 4, 64, seed=46)
    moe._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="attnres.moe"):
        for _ in range(3):
            helper(case, max_tokens=2)
        helper(dataclasses.replace(case, index=case.index[:2], weights=case.weights[:2], shared=None), max_tokens=2)
    lines = [r.getMessage() for r in caplog.records if r.name == "attnres.moe"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("moe_finalize: unfused path (T=3 k=4 D=64 on cpu, world_size=1): T = 3 is above")
    assert lines[1] == "moe_finalize: fused path (T=2 k=4 D=64 on cpu, world_size=1)"


# ------------------------------------------------------------------------------------- custom op, compile
def test_opcheck_and_fake_impl():
    case = make_case(2, 4, 64, seed=51, shared=True, norm=True)
    args = (case.rows, case.weights, case.index, case.shared, case.norm_weight, 1e-5, 1.5)
    torch.library.opcheck(torch.ops.attnres.moe_finalize.default, args)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, Tensor) else t for t in args]
        out = torch.ops.attnres.moe_finalize(*fake)
        assert tuple(out.shape) == (2, 64) and out.dtype == BF16
        with pytest.raises(attnres.ArgumentError, match="index must be a 2-D"):
            torch.ops.attnres.moe_finalize(fake[0], fake[1], fake[2].reshape(-1), None, None, 1e-5, 1.0)


# aot_eager runs Dynamo, the fake implementation and functionalization around the op (what torch.compile
# needs of it); inductor only adds code generation around an opaque call and costs ~20 s on the CI machine.
@pytest.mark.parametrize("backend", ["aot_eager"])
def test_torch_compile(backend):
    case = make_case(2, 8, 64, seed=52, shared=True, norm=True, scale=0.5)

    def tail(rows, weights, index, shared, norm_weight):
        out = attnres.moe_finalize(rows, weights, index, shared=shared, norm_weight=norm_weight, eps=1e-5, scale=0.5)
        return out.float() * 2  # something after the op, so the graph is not the op alone

    compiled = torch.compile(tail, fullgraph=True, backend=backend)
    args = (case.rows, case.weights, case.index, case.shared, case.norm_weight)
    assert_same_bits(compiled(*args), tail(*args), f"torch.compile({backend})")


# ----------------------------------------------------------------------------------------------- CUDA only
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("c", [CASES[i] for i in (1, 2, 3, 9, 12, 16, 17, 18)], ids=case_id)
def test_cuda_matches_cpu_backend(c):
    """The combine and the shared add are bitwise identical across backends; the norm agrees within the
    tolerance (its sum of squares is reduced in a different order)."""
    cpu, gpu = build(c, "cpu"), build(c, "cuda")
    out_cpu, out_gpu = run(cpu), run(gpu)
    if cpu.norm_weight is None:
        assert_same_bits(out_gpu, out_cpu, "CUDA vs CPU")
    else:
        pre_cpu = run(dataclasses.replace(cpu, norm_weight=None))
        pre_gpu = run(dataclasses.replace(gpu, norm_weight=None))
        assert_same_bits(pre_gpu, pre_cpu, "CUDA vs CPU before the norm")
        check_close(out_gpu, out_cpu, "CUDA vs CPU with the norm")


@requires_cuda
@pytest.mark.gpu
def test_cuda_pdl_graph_and_streams_do_not_change_bits():
    case = make_case(2, 16, 3584, seed=61, device="cuda", shared=True, norm=True, scale=2.5)
    eager = run(case)
    assert_same_bits(run(case, pdl=False), eager, "PDL off")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        on_stream = run(case)
    stream.synchronize()
    assert_same_bits(on_stream, eager, "side stream")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(case)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bits(captured, eager, "CUDA graph replay")


@requires_cuda
@pytest.mark.gpu
def test_cuda_rejects_unaligned_views():
    case = _valid("cuda")
    storage = torch.zeros((case.rows.shape[0], 72), dtype=BF16, device="cuda")
    storage[:, 1:65] = case.rows
    with pytest.raises(attnres.ArgumentError, match="rows must be 16-byte aligned for the CUDA kernel"):
        attnres.moe_finalize(storage[:, 1:65], case.weights, case.index, eps=1e-5)
    out_storage = torch.zeros(3 * 64 + 8, dtype=BF16, device="cuda")
    with pytest.raises(attnres.ArgumentError, match="shared must be 16-byte aligned"):
        attnres.moe_finalize(case.rows, case.weights, case.index, shared=out_storage[1:1 + 192].view(3, 64), eps=1e-5)
