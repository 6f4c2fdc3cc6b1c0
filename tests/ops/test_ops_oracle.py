"""Every op against the float64 oracle (attnres.reference) with the contract's tolerance (check_close).

The grid is a covering set, not a product: every T in {1, 2, 3, 5, 8, 16, 31, 32, 33}, every N in 1..16,
every H in {8, 200, 1160, 2304, 4096, 7168, 8192, 16384} (200 and 1160 are odd multiples of 8), every bank
layout, padded prefix rows, the [1, H] res_weight form and three eps pairs (two of them unequal, so a swap of
rms_eps and norm_eps fails — test_unequal_eps_cases_detect_swapped_eps proves it) each appear several times.
On CUDA every case also runs on each per-token kernel the plan accepts when forced.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import attnres
from attnres import reference
from conftest import requires_cuda
from helpers import (BF16, assert_same_bits, assert_storage_unchanged, count_subnormal, kernel_options,
                     make_inputs, oracle, run_add_rmsnorm, run_attn_res, run_persistent, run_rmsnorm)

E_SAME = (1e-5, 1e-5)
E_NORM_BIG = (1e-6, 1e-2)  # rms_eps, norm_eps
E_RMS_BIG = (1e-2, 1e-6)
E_ZERO = (0.0, 1e-5)

# (T, N, H, layout, (rms_eps, norm_eps), extra make_inputs arguments)
CASES = [
    (1, 1, 8, "contiguous", E_SAME, {}),
    (2, 2, 200, "snapshot_major", E_NORM_BIG, {"row_pad": 16}),
    (3, 3, 1160, "token_major", E_RMS_BIG, {}),
    (5, 4, 2304, "snapshot_major", E_SAME, {"weight_2d": True}),
    (8, 5, 4096, "token_major", E_NORM_BIG, {}),
    (16, 6, 1160, "contiguous", E_RMS_BIG, {}),
    (31, 7, 4096, "snapshot_major", E_SAME, {"row_pad": 8}),
    (32, 8, 200, "token_major", E_NORM_BIG, {}),
    (33, 9, 7168, "snapshot_major", E_RMS_BIG, {}),
    (1, 9, 7168, "token_major", E_SAME, {}),  # Kimi K3 decode
    (2, 10, 2304, "token_major", E_RMS_BIG, {"weight_2d": True}),
    (3, 11, 8, "snapshot_major", E_NORM_BIG, {}),
    (5, 12, 7168, "contiguous", E_NORM_BIG, {}),
    (8, 13, 8192, "snapshot_major", E_RMS_BIG, {}),
    (16, 14, 2304, "token_major", E_SAME, {"row_pad": 8}),
    (31, 15, 200, "contiguous", E_SAME, {}),
    (32, 16, 7168, "token_major", E_RMS_BIG, {}),
    (33, 1, 4096, "snapshot_major", E_NORM_BIG, {}),  # K = 0 as a slice of a strided bank
    (3, 16, 16384, "snapshot_major", E_SAME, {}),
    (2, 5, 16384, "token_major", E_ZERO, {"row_pad": 8}),
]


def _case_id(c) -> str:
    T, N, H, layout, eps, extra = c
    tags = "".join(f"-{k}" for k in extra)
    return f"T{T}-N{N}-H{H}-{layout}-eps{eps[0]:g},{eps[1]:g}{tags}"


def _inputs(case, device, addends: int, seed_offset: int = 0):
    T, N, H, layout, (rms_eps, norm_eps), extra = case
    seed = zlib.crc32(_case_id(case).encode()) + seed_offset
    if rms_eps != norm_eps:
        # Rows whose mean square (~1e-3..1e-1) is comparable to the larger eps, so which eps feeds which norm
        # moves the results far outside the tolerance (test_unequal_eps_cases_detect_swapped_eps).
        extra = {"bank_scale": (0.03, 0.3), "prefix_scale": (0.03, 0.3), "add_scale": 0.05, **extra}
    return make_inputs(T, N, H, layout=layout, addends=addends, seed=seed, device=device, rms_eps=rms_eps,
                       norm_eps=norm_eps, **extra)


def _close(actual, expected, what: str, ctx: str, device) -> None:
    assert actual.device.type == torch.device(device).type, f"{ctx}: {what} came back on {actual.device}"
    if actual.dtype == BF16 or expected.dtype == BF16:
        assert actual.dtype == BF16, f"{ctx}: {what} has dtype {actual.dtype}"
    else:
        assert actual.dtype == torch.float32, f"{ctx}: {what} has dtype {actual.dtype}"
    if actual.device.type == "cuda":
        torch.cuda.synchronize(actual.device)
    try:
        reference.check_close(actual.cpu(), expected, what)
    except AssertionError as e:
        raise AssertionError(f"{ctx}: {e}") from None


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_attn_res(case, device):
    inp = _inputs(case, device, addends=0)
    ref = oracle(inp, norm=False)
    for kernel, opts in kernel_options(device, "attn_res", inp.T, inp.N, inp.H, diagnostics=True):
        ctx = f"attn_res {inp.describe()} kernel={kernel}"
        mixture, rsigma, probs, logits = run_attn_res(inp, opts)
        assert mixture.shape == (inp.T, inp.H) and rsigma.shape == probs.shape == logits.shape == (inp.N, inp.T)
        _close(mixture, ref.mixture, "mixture", ctx, device)
        _close(rsigma, ref.rsigma, "rsigma", ctx, device)
        _close(probs, ref.probs, "probs", ctx, device)
        _close(logits, ref.logits, "logits", ctx, device)


@pytest.mark.parametrize("tap", [False, True], ids=["no_tap", "tap"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_attn_res_rmsnorm(case, tap, device):
    inp = _inputs(case, device, addends=0)
    ref = oracle(inp)
    for kernel, opts in kernel_options(device, "attn_res_rmsnorm", inp.T, inp.N, inp.H, tap=tap):
        ctx = f"attn_res_rmsnorm tap={tap} {inp.describe()} kernel={kernel}"
        output, mixture = run_rmsnorm(inp, tap=tap, options=opts)
        _close(output, ref.output, "output", ctx, device)
        if tap:
            _close(mixture, ref.mixture, "mixture", ctx, device)


@pytest.mark.parametrize("extras", ["plain", "tap_snapshot"])
@pytest.mark.parametrize("addends", [1, 2], ids=["add", "add2"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_attn_res_add_rmsnorm(case, addends, extras, device):
    inp = _inputs(case, device, addends=addends)
    ref = oracle(inp)
    tap = extras == "tap_snapshot"
    # A contiguous bank has no row past K to write; the other layouts write their first spare row.
    slot = inp.spare_slot if tap else None
    for kernel, opts in kernel_options(device, "attn_res_add_rmsnorm", inp.T, inp.N, inp.H, add=True,
                                       add2=addends == 2, tap=tap, snapshot=slot is not None):
        ctx = f"attn_res_add_rmsnorm {extras} {inp.describe()} kernel={kernel}"
        before = inp.storage_snapshot()
        updated, output, mixture = run_add_rmsnorm(inp, tap=tap, snapshot_slot=slot, options=opts)
        # updated is bitwise (contract step 1); the oracle's prefix is PyTorch's own bf16 adds.
        assert_same_bits(updated, ref.updated, f"{ctx}: updated")
        _close(output, ref.output, "output", ctx, device)
        if tap:
            _close(mixture, ref.mixture, "mixture", ctx, device)
        assert_storage_unchanged(before, inp, except_bank_row=slot, expected_row=ref.updated if slot is not None else None)


@pytest.mark.parametrize("with_add", [False, True], ids=["no_add", "add"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_attn_res_add_rmsnorm_persistent(case, with_add, device):
    inp = _inputs(case, device, addends=1 if with_add else 0)
    ref = oracle(inp)
    p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=inp.T, candidates=inp.N, hidden=inp.H,
                     device=device, add=with_add, options=attnres.Options(topology="persistent"))
    ctx = f"attn_res_add_rmsnorm_persistent {inp.describe()} plan={p}"
    if device == "cpu":
        assert p.accepted and p.kernel == "cpu", ctx
    elif not p.accepted:
        # This build or device declines the call: the op must raise the plan's reason, and write nothing.
        before = inp.storage_snapshot()
        with pytest.raises(attnres.UnsupportedError) as err:
            run_persistent(inp, with_add=with_add)
        assert str(err.value) == f"attn_res_add_rmsnorm_persistent: {p.decline}"
        assert_storage_unchanged(before, inp)
        return
    updated, output = run_persistent(inp, with_add=with_add)
    if with_add:
        assert_same_bits(updated, ref.updated, f"{ctx}: updated")
    else:
        assert updated is None
    _close(output, ref.output, "output", ctx, device)


# ------------------------------------------------------------------------------------------ special forms
def test_three_d_input_form(device):
    """[T, 1, H] prefix and addends: outputs come back [T, 1, H], bitwise equal to the [T, H] call."""
    inp = make_inputs(5, 4, 2304, layout="token_major", addends=2, seed=11, device=device)
    lr3, add3, add23 = (x.unsqueeze(1) for x in (inp.layer_residual, inp.add, inp.add2))
    w = (inp.res_weight, inp.rms_weight)
    ref = oracle(inp)

    mix3, *diag3 = attnres.attn_res(lr3, inp.block_residual, *w, inp.rms_eps)
    mix2, *diag2 = run_attn_res(inp)
    assert mix3.shape == (5, 1, 2304)
    assert_same_bits(mix3.squeeze(1), mix2, "attn_res mixture [T, 1, H]")
    for a, b, name in zip(diag3, diag2, ("rsigma", "probs", "logits")):
        assert_same_bits(a, b, f"attn_res {name} [T, 1, H]")

    out3, tap3 = attnres.attn_res_rmsnorm(lr3, inp.block_residual, *w, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                          return_mixture=True)
    out2, tap2 = run_rmsnorm(inp, tap=True)
    assert out3.shape == tap3.shape == (5, 1, 2304)
    assert_same_bits(out3.squeeze(1), out2, "attn_res_rmsnorm output [T, 1, H]")
    assert_same_bits(tap3.squeeze(1), tap2, "attn_res_rmsnorm tap [T, 1, H]")

    upd3, out3, tap3 = attnres.attn_res_add_rmsnorm(lr3, add3, inp.block_residual, *w, inp.norm_weight, inp.rms_eps,
                                                    inp.norm_eps, layer_residual_add2=add23, return_mixture=True)
    upd2, out2, tap2 = run_add_rmsnorm(inp, tap=True)
    assert upd3.shape == out3.shape == tap3.shape == (5, 1, 2304)
    assert_same_bits(upd3.squeeze(1), upd2, "attn_res_add_rmsnorm updated [T, 1, H]")
    assert_same_bits(out3.squeeze(1), out2, "attn_res_add_rmsnorm output [T, 1, H]")
    assert_same_bits(tap3.squeeze(1), tap2, "attn_res_add_rmsnorm tap [T, 1, H]")
    assert_same_bits(upd3.squeeze(1), ref.updated, "updated vs torch")
    reference.check_close(out3.squeeze(1).cpu(), ref.output, "output [T, 1, H]")

    p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=5, candidates=4, hidden=2304, device=device, add=True,
                     options=attnres.Options(topology="persistent"))
    if p.accepted:
        one = make_inputs(5, 4, 2304, layout="token_major", addends=1, seed=12, device=device)
        u3, o3 = attnres.attn_res_add_rmsnorm_persistent(
            one.layer_residual.unsqueeze(1), one.block_residual, one.res_weight, one.rms_weight, one.norm_weight,
            one.rms_eps, one.norm_eps, layer_residual_add=one.add.unsqueeze(1))
        u2, o2 = run_persistent(one)
        assert u3.shape == o3.shape == (5, 1, 2304)
        assert_same_bits(u3.squeeze(1), u2, "persistent updated [T, 1, H]")
        assert_same_bits(o3.squeeze(1), o2, "persistent output [T, 1, H]")


@pytest.mark.parametrize("layout", ["contiguous", "snapshot_major", "token_major"])
def test_single_candidate_mixture_is_the_prefix(layout, device):
    """N = 1: the softmax weight is exactly 1 and the mixture is P itself, bit for bit."""
    inp = make_inputs(7, 1, 1160, layout=layout, addends=2, seed=21, device=device)
    P = oracle(inp).updated
    for kernel, opts in kernel_options(device, "attn_res", 7, 1, 1160, diagnostics=True):
        mixture, rsigma, probs, logits = run_attn_res(inp, opts)
        assert_same_bits(mixture, inp.layer_residual, f"attn_res mixture, N = 1, kernel={kernel}")
        assert float((probs.cpu() - 1).abs().max()) <= 1e-6, f"probs, N = 1, kernel={kernel}"
    for kernel, opts in kernel_options(device, "attn_res_rmsnorm", 7, 1, 1160, tap=True):
        output, mixture = run_rmsnorm(inp, tap=True, options=opts)
        assert_same_bits(mixture, inp.layer_residual, f"attn_res_rmsnorm tap, N = 1, kernel={kernel}")
        # With the mixture exact, the trailing norm has only its own two roundings left.
        reference.check_close(output.cpu(), reference.two_rounding_rmsnorm(inp.layer_residual.cpu(),
                                                                           inp.norm_weight.cpu(), inp.norm_eps))
    for kernel, opts in kernel_options(device, "attn_res_add_rmsnorm", 7, 1, 1160, add=True, add2=True, tap=True):
        updated, output, mixture = run_add_rmsnorm(inp, tap=True, options=opts)
        assert_same_bits(updated, P, f"updated, N = 1, kernel={kernel}")
        assert_same_bits(mixture, P, f"attn_res_add_rmsnorm tap, N = 1, kernel={kernel}")


def _all_ops_close(inp, device, ctx: str) -> None:
    ref0, ref0n, ref_add = oracle(inp, addends=0, norm=False), oracle(inp, addends=0), oracle(inp)
    mixture, rsigma, probs, logits = run_attn_res(inp)
    for name, a, e in (("mixture", mixture, ref0.mixture), ("rsigma", rsigma, ref0.rsigma),
                       ("probs", probs, ref0.probs), ("logits", logits, ref0.logits)):
        _close(a, e, name, f"{ctx} attn_res", device)
    output, tap = run_rmsnorm(inp, tap=True)
    _close(output, ref0n.output, "output", f"{ctx} attn_res_rmsnorm", device)
    _close(tap, ref0n.mixture, "mixture", f"{ctx} attn_res_rmsnorm", device)
    updated, output, tap = run_add_rmsnorm(inp, tap=True)
    assert_same_bits(updated, ref_add.updated, f"{ctx} updated")
    _close(output, ref_add.output, "output", f"{ctx} attn_res_add_rmsnorm", device)
    _close(tap, ref_add.mixture, "mixture", f"{ctx} attn_res_add_rmsnorm", device)


def test_large_dynamic_range(device):
    """Rows from 1e-4 to 1e4 and elements spread over six decades inside a row."""
    inp = make_inputs(6, 9, 7168, layout="token_major", addends=2, seed=31, device=device,
                      bank_scale=(1e-4, 1e4), prefix_scale=(1e-3, 1e3), elementwise_range=(1e-3, 1e3))
    _all_ops_close(inp, device, "large dynamic range")


def test_subnormal_rows(device):
    """Bank rows and prefix of subnormal magnitude (~1e-39): the mixture itself is subnormal and must be
    neither flushed nor misrounded; the norm then lifts it into the normal range."""
    # N odd: with the logits underflowing to 0 the weights are exactly 1/N, and a sum of k_n / N quanta is
    # never a rounding tie for odd N; for even N exact ties make the last-bit choice (one subnormal quantum,
    # ~10% of these values) depend on fp32-vs-float64 noise, which no tolerance on so few bits can absorb.
    inp = make_inputs(4, 7, 2304, layout="snapshot_major", addends=1, seed=41, device=device,
                      bank_scale=(5e-40, 3e-39), prefix_scale=(5e-40, 3e-39), add_scale=1e-39)
    assert count_subnormal(inp.block_residual) > 0 and count_subnormal(inp.layer_residual) > 0
    mixture = run_attn_res(inp)[0]
    assert count_subnormal(mixture) > mixture.numel() // 2, "the mixture of subnormal rows should be subnormal"
    _all_ops_close(inp, device, "subnormal rows")


def test_saturated_softmax(device):
    """A pseudo-query of unit scale gives logits in the tens: the softmax must subtract its max."""
    inp = make_inputs(5, 12, 4096, layout="snapshot_major", addends=1, seed=51, device=device, res_weight_scale=1.0)
    ref = oracle(inp, addends=0, norm=False)
    assert ref.logits.abs().max() > 30, "the case should drive the logits far from 0"
    _all_ops_close(inp, device, "saturated softmax")


UNEQUAL_EPS = [c for c in CASES if c[4][0] != c[4][1] and c[4][0] > 0]


@pytest.mark.parametrize("case", UNEQUAL_EPS, ids=_case_id)
def test_unequal_eps_cases_detect_swapped_eps(case, device):
    """The grid's unequal eps pairs have teeth: an implementation that swapped rms_eps and norm_eps, or fed
    one of them to both norms, fails the oracle checks above (the normed output or the scoring diagnostics)."""
    inp = _inputs(case, device, addends=0)
    output, _ = run_rmsnorm(inp)
    rsigma = run_attn_res(inp)[1]
    wrong = {"swapped": (inp.norm_eps, inp.rms_eps), "rms_eps for both": (inp.rms_eps, inp.rms_eps),
             "norm_eps for both": (inp.norm_eps, inp.norm_eps)}
    for name, (rms_eps, norm_eps) in wrong.items():
        ref = oracle(inp, rms_eps=rms_eps, norm_eps=norm_eps)
        caught = []
        for what, actual, expected in (("output", output, ref.output), ("rsigma", rsigma, ref.rsigma)):
            try:
                reference.check_close(actual.cpu(), expected, what)
            except AssertionError:
                caught.append(what)
        assert caught, f"{inp.describe()}: an implementation using {name} would pass every check"


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("H", [40, 80, 200, 1160, 7168])
@pytest.mark.parametrize("cluster", [2, 3, 5, 7, 8])
def test_split_k_cluster_overrides(H, cluster):
    """split_k with cluster sizes the plan accepts, including rows with fewer 16-byte vectors than a
    ceil-divided cluster has blocks (some blocks then own no vector) and clusters clamped to H / 8."""
    inp = make_inputs(5, 7, H, layout="token_major", addends=2, seed=H + cluster, device="cuda")
    opts = attnres.Options(kernel="split_k", cluster=cluster)
    p = attnres.plan("attn_res_add_rmsnorm", tokens=5, candidates=7, hidden=H, device="cuda", add=True, add2=True,
                     tap=True, options=opts)
    if not p.accepted:
        assert "use a larger cluster" in p.decline, p
        return
    ref = oracle(inp)
    ctx = f"split_k cluster={cluster} (plan {p.cluster}x{p.threads}) {inp.describe()}"
    updated, output, mixture = run_add_rmsnorm(inp, tap=True, options=opts)
    assert_same_bits(updated, ref.updated, f"{ctx}: updated")
    _close(output, ref.output, "output", ctx, "cuda")
    _close(mixture, ref.mixture, "mixture", ctx, "cuda")
    ref0 = oracle(inp, addends=0, norm=False)
    mix, rsigma, probs, logits = run_attn_res(inp, opts)
    for name, a, e in (("mixture", mix, ref0.mixture), ("rsigma", rsigma, ref0.rsigma), ("probs", probs, ref0.probs),
                       ("logits", logits, ref0.logits)):
        _close(a, e, name, ctx, "cuda")
