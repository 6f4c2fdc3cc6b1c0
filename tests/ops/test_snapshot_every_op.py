"""The snapshot write without an addend: attn_res and attn_res_rmsnorm with snapshot_slot write layer_residual
itself into bank row snapshot_slot (>= K), change nothing else, and refuse what attn_res_add_rmsnorm refuses,
through the Python wrappers and torch.ops.attnres.* alike."""

from __future__ import annotations

import pytest
import torch

import attnres
from conftest import DEVICES
from helpers import assert_same_bits, assert_storage_unchanged, bits, kernel_options, make_inputs


def _rmsnorm(inp, **kw):
    return attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight,
                                    inp.norm_weight, inp.rms_eps, inp.norm_eps, **kw)


def _attn_res(inp, **kw):
    return attnres.attn_res(inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.rms_eps,
                            **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["snapshot_major", "token_major"])
@pytest.mark.parametrize("op", ["attn_res", "attn_res_rmsnorm"])
def test_snapshot_row_is_layer_residual(device, layout, op):
    for T, N, H in ((1, 2, 128), (5, 9, 1024), (3, 1, 7168)):
        inp = make_inputs(T, N, H, layout=layout, device=device, seed=T + N)
        call = _attn_res if op == "attn_res" else _rmsnorm
        flags = {"diagnostics": True} if op == "attn_res" else {}
        for kernel, opts in kernel_options(device, op, T, N, H, snapshot=True, **flags):
            expected = call(inp, options=opts)
            before = inp.storage_snapshot()
            got = call(inp, snapshot_slot=inp.spare_slot, options=opts)
            what = f"{op} T={T} N={N} H={H} {layout} {kernel}"
            assert_same_bits(inp.bank_row(inp.spare_slot), inp.layer_residual, f"{what}: snapshot row")
            assert_storage_unchanged(before, inp, except_bank_row=inp.spare_slot, expected_row=inp.layer_residual)
            for e, g in zip(expected if isinstance(expected, tuple) else (expected,),
                            got if isinstance(got, tuple) else (got,)):
                assert_same_bits(g, e, f"{what}: outputs unchanged by the snapshot write")
            inp.bank_row(inp.spare_slot).fill_(float("nan"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["attn_res", "attn_res_rmsnorm"])
def test_snapshot_rejections_write_nothing(device, op):
    inp = make_inputs(2, 3, 256, device=device, spare_rows=1)
    before = inp.storage_snapshot()
    call = _attn_res if op == "attn_res" else _rmsnorm
    K = inp.K
    for slot, message in ((K - 1, "is a candidate"), (-2, "snapshot_slot must be"), (K + 5, "outside")):
        with pytest.raises((attnres.ArgumentError, ValueError), match=message):
            call(inp, snapshot_slot=slot)
    bank = inp.bank_buffer
    w = (inp.res_weight, inp.rms_weight)
    with pytest.raises(attnres.ArgumentError, match="num_snapshots"):
        torch.ops.attnres.attn_res_snapshot(inp.layer_residual, bank, bank.shape[0] + 3, K, *w, 1e-5)
    with pytest.raises(attnres.ArgumentError, match="num_snapshots"):
        torch.ops.attnres.attn_res_rmsnorm_snapshot(inp.layer_residual, bank, -1, K, *w, inp.norm_weight, 1e-5,
                                                    1e-5)
    with pytest.raises(ValueError, match="outside"):
        torch.ops.attnres.attn_res_rmsnorm_snapshot(inp.layer_residual, bank, K, bank.shape[0], *w,
                                                    inp.norm_weight, 1e-5, 1e-5)
    # layer_residual inside the bank row it would be written to: an output aliasing an input.
    alias = inp.bank_row(inp.spare_slot)
    with pytest.raises(attnres.ArgumentError, match="overlaps"):
        attnres.attn_res(alias, inp.block_residual, *w, 1e-5, snapshot_slot=inp.spare_slot)
    for name, buf in inp.storage_snapshot().items():
        assert torch.equal(bits(buf), bits(before[name])), name


def test_plan_accepts_the_snapshot_on_every_kernel():
    for op in ("attn_res", "attn_res_rmsnorm"):
        assert attnres.plan(op, tokens=2, candidates=3, hidden=256, snapshot=True).accepted
        for gpu in ("h100", "h200"):
            for opts in (attnres.Options(kernel="single_cta"), attnres.Options(kernel="split_k"),
                         attnres.Options(topology="persistent")):
                p = attnres.plan(op, tokens=2, candidates=3, hidden=256, snapshot=True, device=gpu, options=opts)
                assert p.accepted, (op, gpu, opts, p)
    p = attnres.plan("attn_res", tokens=2, candidates=3, hidden=256, snapshot=True, diagnostics=True, device="h200",
                     options=attnres.Options(topology="persistent"))
    assert p.accepted and p.kernel != "persistent", p  # the diagnostics keep attn_res on the per-token kernels
