"""One set of output bits for every CUDA kernel (all CUDA-only, skipped elsewhere).

Every CUDA kernel reduces in split_k's order, a function of H alone (plan_tuning.hpp split_k_chunk), and uses
the same softmax and mixture arithmetic, so a token's `output`, the mixture (the tap; attn_res's mixture and
fp32 diagnostics) and `updated` are bitwise identical whichever kernel runs it. Checked over the grid: every N
in 1..16, H from one vector to 16384 (odd multiples of 8 that leave partial warps and short last chunks
included), T = 1, 3, 64, 300, snapshot-major and token-major banks, no addend / one / two, with and without the
tap, on every kernel the plan accepts when forced: split_k (the reference), single_cta, split_k with a cluster
of one (a one-block launch), and persistent (through Options(kernel="persistent") and the persistent op).
The persistent kernel declines the tap; with two addends it is compared directly and also on the materialized
one-addend call (the fold is bitwise invisible on every kernel, tests/ops/test_bitwise.py).

Every result is cloned and the kernel's own output tensors are poisoned (NaN) before they are freed, so a
kernel that leaves an output unwritten cannot pass by inheriting the previous kernel's bits from the caching
allocator. The CPU backend is not part of the guarantee (its rsqrt and exp are the exact functions, not the
GPU's MUFU approximations); tests/ops/test_ops_oracle.py holds both to the float64 oracle.
"""

from __future__ import annotations

import pytest
import torch

import attnres
from conftest import requires_cuda
from helpers import Inputs

pytestmark = [requires_cuda, pytest.mark.gpu]

HIDDEN = [8, 64, 200, 1024, 1160, 2048, 2056, 4096, 7168, 7176, 8192, 16384]
TOKENS = [1, 3, 64, 300]
LAYOUTS = ["snapshot_major", "token_major"]
REFERENCE = "split_k"
FORCED = {
    "single_cta": attnres.Options(kernel="single_cta"),
    "split_k_cluster_1": attnres.Options(kernel="split_k", cluster=1),
    "persistent": attnres.Options(kernel="persistent"),
}


def _inputs(T: int, N: int, H: int, layout: str, addends: int, seed: int) -> Inputs:
    from test_persistent import gpu_inputs  # the persistent tests' GPU-side generator (fast at large T * H)
    inp = gpu_inputs(T, N, H, layout=layout, add=addends >= 1, seed=seed)
    if addends == 2:
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        inp.add2 = (torch.randn(T, H, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
        inp.buffers["add2"] = inp.add2
    return inp


def _kept(result):
    """Clones of a call's tensors, then NaN into the call's own outputs (see the module docstring)."""
    tensors = result if isinstance(result, tuple) else (result,)
    kept = tuple(None if t is None else t.clone() for t in tensors)
    for t in tensors:
        if t is not None and t.is_floating_point():
            t.fill_(float("nan"))
    return kept


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(view),
                                                                     b.contiguous().view(view))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    diff = a.contiguous().view(view) != b.contiguous().view(view)
    idx = tuple(diff.nonzero()[0].tolist())
    return f"{int(diff.sum())} of {diff.numel()} differ; first at {list(idx)}: {a[idx].item()!r} vs {b[idx].item()!r}"


class Op:
    """One op and flag set: how to call it and what the plan is asked."""

    def __init__(self, name: str, addends: int, tap: bool, diagnostics: bool = True):
        self.name, self.addends, self.tap = name, addends, tap
        self.diagnostics = diagnostics and name == "attn_res"  # attn_res's fp32 diagnostics (per-token only)

    def __repr__(self) -> str:
        return f"{self.name}(addends={self.addends}, tap={self.tap}, diagnostics={self.diagnostics})"

    def plan(self, inp: Inputs, options: attnres.Options):
        return attnres.plan(self.name, tokens=inp.T, candidates=inp.N, hidden=inp.H, device="cuda",
                            add=self.addends >= 1, add2=self.addends == 2, tap=self.tap,
                            diagnostics=self.diagnostics, options=options)

    def __call__(self, inp: Inputs, options: attnres.Options, add=None):
        w = (inp.res_weight, inp.rms_weight)
        if self.name == "attn_res":
            adds = {} if self.addends == 0 else {
                "layer_residual_add": inp.add if add is None else add,
                "layer_residual_add2": inp.add2 if add is None and self.addends == 2 else None}
            return _kept(attnres.attn_res(inp.layer_residual, inp.block_residual, *w, inp.rms_eps, **adds,
                                          diagnostics=self.diagnostics, options=options))
        w = (*w, inp.norm_weight, inp.rms_eps, inp.norm_eps)
        if self.name == "attn_res_rmsnorm":
            r = attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, return_mixture=self.tap,
                                         options=options)
            return _kept(r)
        if self.name == "attn_res_add_rmsnorm_persistent":
            return _kept(attnres.attn_res_add_rmsnorm_persistent(inp.layer_residual, inp.block_residual, *w,
                                                                 layer_residual_add=inp.add, options=options))
        r = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add if add is None else add, inp.block_residual, *w,
                                         layer_residual_add2=inp.add2 if add is None else None,
                                         return_mixture=self.tap, options=options)
        return _kept(r)


def _ops(addends: int) -> list[Op]:
    # attn_res with the fp32 diagnostics runs on the per-token kernels only, without them on every kernel.
    if addends == 0:
        return [Op("attn_res", 0, False), Op("attn_res", 0, False, diagnostics=False), Op("attn_res_rmsnorm", 0, False),
                Op("attn_res_rmsnorm", 0, True)]
    return [Op("attn_res_add_rmsnorm", addends, False), Op("attn_res_add_rmsnorm", addends, True),
            Op("attn_res", addends, False, diagnostics=False)]


def _compare(want, got, what: str) -> list[str]:
    bad = []
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None and b is None:
            continue
        if a is None or b is None or not _same_bits(a, b):
            detail = "one side missing" if a is None or b is None else _first_difference(a, b)
            bad.append(f"{what}: output {i}: {detail}")
    return bad


def _check_case(T: int, N: int, H: int, layout: str, addends: int) -> tuple[list[str], list[str]]:
    """(mismatches, the kernels compared) for one input set, every op and kernel against split_k."""
    inp = _inputs(T, N, H, layout, addends, seed=(T * 131 + N) * 17 + H + addends)
    reference_opts = attnres.Options(kernel=REFERENCE)
    bad, compared = [], []
    for op in _ops(addends):
        ctx = f"{op} T={T} N={N} H={H} {layout}"
        assert op.plan(inp, reference_opts).kernel == REFERENCE, ctx
        want = op(inp, reference_opts)
        for name, opts in FORCED.items():
            if not op.plan(inp, opts).accepted:
                continue
            bad += _compare(want, op(inp, opts), f"{ctx}: {name} vs split_k")
            compared.append(name)
        if op.addends == 2 and not op.tap:
            # The persistent kernel on add = bf16(add + add2) (PyTorch's rounding): updated and output.
            one = Op("attn_res" if op.name == "attn_res" else "attn_res_add_rmsnorm", 1, False, diagnostics=False)
            summed = inp.add + inp.add2
            if one.plan(inp, FORCED["persistent"]).accepted:
                got = one(inp, FORCED["persistent"], add=summed)
                bad += _compare(want[:2], got[:2], f"{ctx}: persistent on add + add2 vs split_k with two addends")
                compared.append("persistent")
    if addends == 1:
        persistent_op = Op("attn_res_add_rmsnorm_persistent", 1, False)
        want = Op("attn_res_add_rmsnorm", 1, False)(inp, reference_opts)[:2]
        if persistent_op.plan(inp, attnres.Options()).accepted:
            bad += _compare(want, persistent_op(inp, attnres.Options()),
                            f"persistent op T={T} N={N} H={H} {layout} vs split_k")
            compared.append("persistent")
    return bad, compared


@pytest.mark.parametrize("addends", [0, 1, 2])
@pytest.mark.parametrize("H", HIDDEN)
def test_every_kernel_gives_split_k_bits(H, addends):
    bad, compared = [], []
    for N in range(1, 17):
        for T in TOKENS:
            for layout in LAYOUTS:
                b, c = _check_case(T, N, H, layout, addends)
                bad += b
                compared += c
    kinds = set(compared)
    assert not bad, f"{len(bad)} mismatches over {len(compared)} comparisons:\n" + "\n".join(bad[:20])
    # What the grid must have reached at this H: persistent everywhere; single_cta up to H = 8192 (N <= 4);
    # the one-block split_k up to H = 2048.
    assert "persistent" in kinds, kinds
    assert ("single_cta" in kinds) == (H <= 8192), kinds
    assert ("split_k_cluster_1" in kinds) == (H <= 2048), kinds


def test_the_comparison_sees_a_different_order():
    """The bit comparison has teeth: a forced cluster of 8 at H = 7168 (split_k's default is 7, so the rank
    chunks and the order of the sums differ) changes some bits of a T = 300 call."""
    inp = _inputs(300, 9, 7168, "token_major", 1, seed=5)
    op = Op("attn_res_add_rmsnorm", 1, True)
    default = op(inp, attnres.Options(kernel="split_k"))
    other = op(inp, attnres.Options(kernel="split_k", cluster=8))
    assert attnres.plan("attn_res_add_rmsnorm", tokens=300, candidates=9, hidden=7168, device="cuda", add=True,
                        options=attnres.Options(kernel="split_k")).cluster == 7
    assert _same_bits(default[0], other[0]), "updated is exact on every kernel"
    assert not _same_bits(default[1], other[1]), "a different summation order changed no output bit"


CANDIDATE_BUCKETS = tuple(attnres._C.limits["candidate_buckets"])  # attnres/limits.hpp kCandidateBuckets


def _negative_zero_inputs(T: int, N: int, H: int, addends: int, e: int) -> Inputs:
    """Inputs whose mixture element `e` is -0 after the N real candidates: the bank rows are +1 with -0 at e
    (each adds fma(p, -0, +0) = +0), and P, the last candidate, is +1 with 21 elements -1 (its logit about 42 below
    the bank rows', so p ~ 2^-60) and -2^-100 at e, whose product with p rounds to -0. Weights 1; the addends -0
    (P = prefix + -0 = prefix)."""
    inp = _inputs(T, N, H, "snapshot_major", addends, seed=N * 7 + H)
    for w in (inp.res_weight, inp.rms_weight, inp.norm_weight):
        w.fill_(1.0)
    inp.block_residual.fill_(1.0)
    inp.block_residual[:, :, e] = -0.0
    inp.layer_residual.fill_(1.0)
    inp.layer_residual[:, H - 21:] = -1.0
    inp.layer_residual[:, e] = -(2.0 ** -100)
    for add in (inp.add, inp.add2):
        if add is not None:
            add.fill_(-0.0)
    return inp


@pytest.mark.parametrize("addends", [0, 1, 2])
@pytest.mark.parametrize("H", [1024, 7168])
def test_a_mixture_over_a_padded_bucket_adds_plus_zero(H, addends):
    """The mixture's bits are those of the whole N bucket: each row past N adds fma(+0, +0, acc), turning a -0
    element into +0 (the per-token and streaming kernels mix the whole bucket; the persistent kernel adds +0 once,
    `mix_pad`). So a mixture element that is -0 after the real candidates stays -0 where N is a bucket and becomes
    +0 where it is not, on every kernel; and the normed output (weight 1) keeps that sign. Random inputs never
    reach this case, so the bit comparisons above cannot see a kernel that drops the padding."""
    T, e = 3, 5
    checked = 0
    for N in range(2, 17):
        inp = _negative_zero_inputs(T, N, H, addends, e)
        negative = N in CANDIDATE_BUCKETS
        for op in _ops(addends):
            for name, opts in {REFERENCE: attnres.Options(kernel=REFERENCE), **FORCED}.items():
                if not op.plan(inp, opts).accepted:
                    continue
                result = op(inp, opts)
                # The mixture (attn_res: first after `updated`, before the diagnostics; the tap: last) or the
                # normed output.
                mixed = result[op.addends >= 1] if op.name == "attn_res" else result[-1]
                bits = mixed[:, e].contiguous().view(torch.int16).tolist()
                want = -32768 if negative else 0  # bf16 -0 (0x8000) / +0
                assert bits == [want] * T, f"{op} {name} N={N} H={H}: element {e} bits {bits}, want {want}"
                checked += 1
    assert checked >= 15 * (4 if addends == 0 else 3), checked
