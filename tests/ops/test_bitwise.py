"""The contract's bitwise properties (docs/ops/common.md, section 8, and the op pages).

* updated == PyTorch's `prefix + (add + add2)` (and `prefix + add`) bit for bit, subnormals included;
* with two addends, updated/output/tap equal the one-addend call on the bf16 sum, and the no-add op on the
  materialized prefix (the fold is bitwise invisible);
* identical calls give identical bits; a token's result does not depend on T or on its position;
* nothing but a requested snapshot row is written; the snapshot row equals updated;
* CUDA updated == CPU-backend updated == PyTorch.
"""

from __future__ import annotations

import pytest
import torch

import attnres
from conftest import requires_cuda
from helpers import (BF16, assert_same_bits, assert_storage_unchanged, count_subnormal, kernel_options,
                     make_inputs, oracle, run_add_rmsnorm, run_attn_res, run_persistent, run_rmsnorm)

Q = 2.0 ** -133  # the bf16 quantum of the subnormal range and of the smallest normal binade


def _subnormal_addends(T: int, H: int, seed: int):
    """(prefix, add, add2) bf16 [T, H] on the CPU whose columns, in groups of H/8, hold:
    0: subnormal prefix and addends;  1: add + add2 cancelling exactly to a subnormal;  2: prefix + (add + add2)
    cancelling exactly to a subnormal;  3: subnormal add + add2 absorbed by a normal prefix;  4: add2 the exact
    negative of add (S = 0, P = prefix);  5..7: ordinary values of mixed magnitude (rounding in the adds)."""
    g = torch.Generator().manual_seed(seed)
    assert H % 8 == 0 and H >= 64
    w = H // 8

    def ints(lo, hi, shape):  # multiples of Q: exactly representable below 2^-125
        return torch.randint(lo, hi, shape, generator=g).double() * Q

    def signs(shape):
        return torch.randint(0, 2, shape, generator=g).double() * 2 - 1

    shape = (T, w)
    prefix, add, add2 = (torch.randn(T, H, generator=g, dtype=torch.float64) for _ in range(3))
    cols = [slice(i * w, (i + 1) * w) for i in range(8)]
    # 0: subnormal inputs (sums stay subnormal or cross into the smallest normal binade)
    prefix[:, cols[0]], add[:, cols[0]], add2[:, cols[0]] = (ints(1, 128, shape) * signs(shape) for _ in range(3))
    # 1: add normal (k1 in [128, 256)), add2 = -(k1 - k2) Q with k2 subnormal: S = k2 Q exactly
    k1, k2, s = ints(128, 256, shape), ints(1, 128, shape), signs(shape)
    add[:, cols[1]], add2[:, cols[1]] = s * k1, -s * (k1 - k2)
    # 2: S = (ka + kb) Q normal, prefix = -(S - d) with d subnormal: P = d exactly
    ka, kb, d, s = ints(64, 120, shape), ints(64, 120, shape), ints(1, 128, shape), signs(shape)
    add[:, cols[2]], add2[:, cols[2]], prefix[:, cols[2]] = s * ka, s * kb, -s * (ka + kb - d)
    # 3: subnormal S added to a normal prefix
    add[:, cols[3]], add2[:, cols[3]] = ints(1, 60, shape) * signs(shape), ints(1, 60, shape) * signs(shape)
    # 4: exact cancellation of the addends
    add2[:, cols[4]] = -add[:, cols[4]]
    # 5..7: magnitudes from 1e-3 to 1e3 so the adds round
    for c in cols[5:]:
        for x in (prefix, add, add2):
            x[:, c] *= torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(-7, 7, generator=g))
    return prefix.to(BF16), add.to(BF16), add2.to(BF16)


def _with_prefix(inp, prefix, add, add2):
    inp.layer_residual.copy_(prefix.to(inp.device))
    inp.add.copy_(add.to(inp.device))
    inp.add2.copy_(add2.to(inp.device))
    return inp


def test_subnormal_construction_is_what_it_claims():
    prefix, add, add2 = _subnormal_addends(3, 256, seed=1)
    w = 32
    S = add + add2
    P = prefix + S
    assert count_subnormal(prefix[:, :w]) == prefix[:, :w].numel()
    assert count_subnormal(S[:, w:2 * w]) == S[:, w:2 * w].numel()
    assert count_subnormal(P[:, 2 * w:3 * w]) == P[:, 2 * w:3 * w].numel()
    assert bool((S[:, 4 * w:5 * w] == 0).all())


@pytest.mark.parametrize("H", [256, 7168])
def test_updated_is_torch_add_bit_for_bit_with_subnormals(H, device):
    """updated == prefix + (add + add2) and == prefix + add, as PyTorch computes them on bf16 (no flush)."""
    T, N = 5, 4
    prefix, add, add2 = _subnormal_addends(T, H, seed=H)
    expected2 = prefix + (add + add2)
    expected1 = prefix + add
    assert count_subnormal(expected2) > 0 and count_subnormal(expected1) > 0, "the case must produce subnormals"
    assert count_subnormal(add + add2) > 0

    inp = _with_prefix(make_inputs(T, N, H, layout="token_major", addends=2, seed=H, device=device),
                       prefix, add, add2)
    for kernel, opts in kernel_options(device, "attn_res_add_rmsnorm", T, N, H, add=True, add2=True):
        updated, output, _ = run_add_rmsnorm(inp, options=opts)
        assert_same_bits(updated, expected2, f"updated with two addends, kernel={kernel}")
        assert torch.isfinite(output.float()).all()
    for kernel, opts in kernel_options(device, "attn_res_add_rmsnorm", T, N, H, add=True):
        updated, _, _ = run_add_rmsnorm(inp, options=opts, add=inp.add, add2=None)
        assert_same_bits(updated, expected1, f"updated with one addend, kernel={kernel}")
    p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=T, candidates=N, hidden=H, device=device, add=True,
                     options=attnres.Options(topology="persistent"))
    if p.accepted:
        updated, _ = run_persistent(inp)
        assert_same_bits(updated, expected1, f"persistent updated, kernel={p.kernel}")


def test_cpu_backend_keeps_subnormals_under_host_flush_to_zero():
    """A host process that set flush-to-zero/denormals-are-zero (some libraries do) must not change the CPU
    backend's prefix update."""
    T, N, H = 3, 3, 256
    prefix, add, add2 = _subnormal_addends(T, H, seed=7)
    expected = prefix + (add + add2)  # computed before the mode changes
    inp = _with_prefix(make_inputs(T, N, H, addends=2, seed=7), prefix, add, add2)
    ref = oracle(inp)
    if not torch.set_flush_denormal(True):
        pytest.fail("this CPU cannot set flush-to-zero, so the test would prove nothing")
    try:
        assert float(torch.tensor([1e-39]) * 1) == 0.0  # the mode is really on for this thread
        updated, output, mixture = run_add_rmsnorm(inp, tap=True)
    finally:
        torch.set_flush_denormal(False)
    assert_same_bits(updated, expected, "updated under host FTZ/DAZ")
    attnres.reference.check_close(output, ref.output, "output under host FTZ/DAZ")


def _forced(device, op: str, N: int, H: int, **flags) -> list[tuple[str, attnres.Options]]:
    """Options that pin one kernel regardless of T (the automatic choice may depend on T)."""
    if torch.device(device).type == "cpu":
        return [("cpu", attnres.Options())]
    out = []
    for kernel in ("single_cta", "split_k"):
        opts = attnres.Options(kernel=kernel)
        if all(attnres.plan(op, tokens=T, candidates=N, hidden=H, device=device, options=opts, **flags).accepted
               for T in (1, 64)):
            out.append((kernel, opts))
    assert out, f"no per-token kernel accepts {op} N={N} H={H}"
    return out


@pytest.mark.parametrize("N,H,layout", [(5, 4096, "token_major"), (3, 200, "snapshot_major"),
                                        (9, 7168, "snapshot_major")])
def test_two_addends_equal_one_addend_on_the_bf16_sum_and_the_materialized_prefix(N, H, layout, device):
    T = 6
    inp = make_inputs(T, N, H, layout=layout, addends=2, seed=N * H, device=device)
    S = inp.add + inp.add2  # bf16, PyTorch's rounding
    P = inp.layer_residual + S
    for kernel, opts in _forced(device, "attn_res_add_rmsnorm", N, H, add=True, add2=True, tap=True):
        u2, o2, t2 = run_add_rmsnorm(inp, tap=True, options=opts)
        u1, o1, t1 = run_add_rmsnorm(inp, tap=True, options=opts, add=S, add2=None)
        o0, t0 = attnres.attn_res_rmsnorm(P, inp.block_residual, inp.res_weight, inp.rms_weight, inp.norm_weight,
                                          inp.rms_eps, inp.norm_eps, return_mixture=True, options=opts)
        for name, a, b in (("updated", u2, u1), ("output", o2, o1), ("tap", t2, t1)):
            assert_same_bits(a, b, f"{name}: add2 call vs one addend on the bf16 sum, kernel={kernel}")
        assert_same_bits(u2, P, f"updated vs materialized prefix, kernel={kernel}")
        assert_same_bits(o2, o0, f"output vs attn_res_rmsnorm on the materialized prefix, kernel={kernel}")
        assert_same_bits(t2, t0, f"tap vs attn_res_rmsnorm on the materialized prefix, kernel={kernel}")


def _every_op_once(inp, opts, slot=None):
    """All outputs of every op for the case (add_rmsnorm with both addends, the tap and optionally a
    snapshot write), as a name -> tensor dict."""
    out = {}
    out["attn_res.mixture"], out["attn_res.rsigma"], out["attn_res.probs"], out["attn_res.logits"] = \
        run_attn_res(inp, opts)
    out["rmsnorm.output"], out["rmsnorm.tap"] = run_rmsnorm(inp, tap=True, options=opts)
    out["add_rmsnorm.updated"], out["add_rmsnorm.output"], out["add_rmsnorm.tap"] = \
        run_add_rmsnorm(inp, tap=True, snapshot_slot=slot, options=opts)
    return out


@pytest.mark.parametrize("N,H", [(4, 2304), (9, 7168), (16, 1160)])
def test_identical_calls_give_identical_bits(N, H, device):
    inp = make_inputs(7, N, H, layout="token_major", addends=2, seed=N, device=device)
    for kernel, opts in kernel_options(device, "attn_res_add_rmsnorm", 7, N, H, add=True, add2=True, tap=True):
        first = _every_op_once(inp, opts)
        for _ in range(2):
            again = _every_op_once(inp, opts)
            for name in first:
                assert_same_bits(again[name], first[name], f"{name} on a repeated call, kernel={kernel}")
    p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=7, candidates=N, hidden=H, device=device, add=True,
                     options=attnres.Options(topology="persistent"))
    if p.accepted:
        u1, o1 = run_persistent(inp)
        u2, o2 = run_persistent(inp)
        assert_same_bits(u2, u1, "persistent updated on a repeated call")
        assert_same_bits(o2, o1, "persistent output on a repeated call")


def _token_slice(inp, idx):
    """The same case restricted to the tokens `idx` (a slice keeps strided views, a list gathers copies)."""
    import copy
    sub = copy.copy(inp)
    if isinstance(idx, slice):
        take = lambda x: x[idx]  # noqa: E731
        sub.block_residual = inp.block_residual[:, idx]
    else:
        index = torch.tensor(idx, device=inp.device)
        take = lambda x: x.index_select(0, index)  # noqa: E731
        sub.block_residual = inp.block_residual.index_select(1, index)
    sub.layer_residual, sub.add, sub.add2 = take(inp.layer_residual), take(inp.add), take(inp.add2)
    sub.T = sub.layer_residual.shape[0]
    return sub


@pytest.mark.parametrize("N,H", [(5, 4096), (3, 200), (12, 7168)])
def test_token_result_independent_of_T_and_position(N, H, device):
    T = 13
    inp = make_inputs(T, N, H, layout="token_major", addends=2, seed=100 + N, device=device)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(N)).tolist()
    for kernel, opts in _forced(device, "attn_res_add_rmsnorm", N, H, add=True, add2=True, tap=True):
        batch = _every_op_once(inp, opts)
        # each token alone (T = 1, strided views into the batch's buffers)
        for t in (0, 6, T - 1):
            alone = _every_op_once(_token_slice(inp, slice(t, t + 1)), opts)
            for name, full in batch.items():
                want = full[:, t:t + 1] if full.dtype == torch.float32 else full[t:t + 1]
                assert_same_bits(alone[name], want, f"{name} of token {t} alone vs in the batch, kernel={kernel}")
        # the tokens in another order, and a sub-batch of a different T
        shuffled = _every_op_once(_token_slice(inp, perm), opts)
        part = _every_op_once(_token_slice(inp, slice(3, 10)), opts)
        for name, full in batch.items():
            is_diag = full.dtype == torch.float32
            index = torch.tensor(perm, device=full.device)
            want = full.index_select(1 if is_diag else 0, index)
            assert_same_bits(shuffled[name], want, f"{name} with the tokens permuted, kernel={kernel}")
            want = full[:, 3:10] if is_diag else full[3:10]
            assert_same_bits(part[name], want, f"{name} in a T = 7 sub-batch, kernel={kernel}")


@pytest.mark.parametrize("layout", ["contiguous", "snapshot_major", "token_major"])
def test_no_op_writes_its_inputs(layout, device):
    inp = make_inputs(4, 6, 1160, layout=layout, addends=2, seed=5, device=device, row_pad=8)
    before = inp.storage_snapshot()
    for kernel, opts in kernel_options(device, "attn_res_add_rmsnorm", 4, 6, 1160, add=True, add2=True, tap=True):
        _every_op_once(inp, opts)
        assert_storage_unchanged(before, inp)
    p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=4, candidates=6, hidden=1160, device=device, add=True,
                     options=attnres.Options(topology="persistent"))
    if p.accepted:
        run_persistent(inp)
        run_persistent(inp, with_add=False)
        assert_storage_unchanged(before, inp)


@pytest.mark.parametrize("layout", ["snapshot_major", "token_major"])
@pytest.mark.parametrize("which_slot", ["first_spare", "last_spare"])
def test_snapshot_writes_exactly_its_row(layout, which_slot, device):
    T, N, H = 5, 4, 2304
    inp = make_inputs(T, N, H, layout=layout, addends=2, seed=9, device=device, spare_rows=3)
    slot = inp.K if which_slot == "first_spare" else inp.K + 2
    assert bool(torch.isnan(inp.bank_row(slot).float()).all()), "the target row starts poisoned"
    ref = oracle(inp)
    for kernel, opts in kernel_options(device, "attn_res_add_rmsnorm", T, N, H, add=True, add2=True, snapshot=True):
        inp.bank_row(slot).fill_(float("nan"))  # each kernel must write the row itself
        before = inp.storage_snapshot()
        updated, output, _ = run_add_rmsnorm(inp, snapshot_slot=slot, options=opts)
        assert_same_bits(updated, ref.updated, f"updated, kernel={kernel}")
        assert_same_bits(inp.bank_row(slot), updated, f"snapshot row {slot} vs updated, kernel={kernel}")
        assert_storage_unchanged(before, inp, except_bank_row=slot, expected_row=updated)
        # The row is not a candidate of the call: the output equals the call without the snapshot write.
        _, plain, _ = run_add_rmsnorm(inp, options=opts)
        assert_same_bits(output, plain, f"output with vs without the snapshot write, kernel={kernel}")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("N,H", [(2, 256), (5, 7168), (9, 7168), (16, 16384)])
def test_cuda_updated_equals_cpu_backend_equals_torch(N, H):
    T = 9
    prefix, add, add2 = _subnormal_addends(T, H, seed=N)
    expected = prefix + (add + add2)
    torch_cuda = (prefix.cuda() + (add.cuda() + add2.cuda())).cpu()
    cpu_inp = _with_prefix(make_inputs(T, N, H, addends=2, seed=N, device="cpu"), prefix, add, add2)
    gpu_inp = _with_prefix(make_inputs(T, N, H, addends=2, seed=N, device="cuda"), prefix, add, add2)
    cpu_updated = run_add_rmsnorm(cpu_inp)[0]
    assert_same_bits(cpu_updated, expected, "CPU backend updated vs torch (CPU)")
    assert_same_bits(torch_cuda, expected, "torch CUDA add vs torch CPU add")
    for kernel, opts in kernel_options("cuda", "attn_res_add_rmsnorm", T, N, H, add=True, add2=True):
        gpu_updated = run_add_rmsnorm(gpu_inp, options=opts)[0]
        torch.cuda.synchronize()
        assert_same_bits(gpu_updated, cpu_updated, f"CUDA updated vs CPU backend, kernel={kernel}")
