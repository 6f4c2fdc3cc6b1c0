"""The persistent kernel with two addends (all CUDA-only, skipped elsewhere): the second addend streams as one more
ring row and `updated` = bf16(prefix + bf16(add + add2)), the per-token kernels' update (cpp/src/cuda/
attn_res_persistent.cuh, attn_res_steps.cuh add_to_prefix). Held to split_k's bits (the reference order) on every
geometry (one and two blocks per SM, one pass and two, the three-slot ring two passes need), every vector bucket,
the normed op with and without FP8 and attn_res (the mixture), with the snapshot write and the prefix updated in
place; outputs poisoned first, inputs unchanged; and against the float64 oracle on sampled tokens."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import _persistent_tuning as tuning, reference
from conftest import requires_cuda
from helpers import assert_same_bits, assert_storage_unchanged
from test_persistent import check_rows, gpu_inputs, sample_tokens

pytestmark = [requires_cuda, pytest.mark.gpu]

BF16 = torch.bfloat16
SPLIT_K = attnres.Options(kernel="split_k")


def _inputs(T: int, N: int, H: int, seed: int):
    inp = gpu_inputs(T, N, H, add=True, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 7)
    inp.add2 = (torch.randn(T, H, generator=g, device="cuda") * 0.5).to(BF16)
    inp.buffers["add2"] = inp.add2
    return inp


def _normed(inp, options, **kw):
    return attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, inp.res_weight,
                                        inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                        layer_residual_add2=inp.add2, options=options, **kw)


def _mixture(inp, options):
    return attnres.attn_res(inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.rms_eps,
                            layer_residual_add=inp.add, layer_residual_add2=inp.add2, diagnostics=False,
                            options=options)


VARIANTS = [tuning.Variant("plan"), tuning.Variant("one block", blocks_per_sm=1),
            tuning.Variant("two blocks", blocks_per_sm=2), tuning.Variant("two passes", passes=2),
            tuning.Variant("three slots", slots=3, passes=2)]


@pytest.mark.parametrize("T,N,H", [(1, 1, 1024), (5, 2, 7168), (133, 5, 7168), (300, 9, 7168), (40, 16, 7168),
                                   (9, 6, 2560), (7, 3, 1152), (3, 9, 16384), (70, 4, 4096)])
def test_two_addends_give_split_k_bits_on_every_geometry(T, N, H):
    inp = _inputs(T, N, H, seed=T * 31 + N + H)
    before = inp.storage_snapshot()
    calls = {"normed": lambda o: _normed(inp, o), "mixture": lambda o: _mixture(inp, o),
             "block128": lambda o: _normed(inp, o, fp8="block128"),
             "per_token": lambda o: _normed(inp, o, fp8="per_token")}
    for name, call in calls.items():
        want = [t.clone() for t in call(SPLIT_K)]
        for variant in VARIANTS:
            op = "attn_res" if name == "mixture" else "attn_res_add_rmsnorm"
            q = attnres.plan(op, tokens=T, candidates=N, hidden=H, device="cuda", add=True, add2=True,
                             fp8=name if name in ("block128", "per_token") else None, options=variant.options())
            ctx = f"T={T} N={N} H={H} {name} {variant.name}"
            if not q.accepted:  # a geometry H or the ring does not allow (two blocks at H > 7168, three slots)
                assert q.decline_code in ("persistent_two_blocks_threads", "persistent_slots",
                                          "persistent_one_pass"), (ctx, q)
                continue
            assert q.kernel == "persistent", (ctx, q)
            got = call(variant.options())
            for t in got:
                t.view(torch.uint8).fill_(0x7F) if t.dtype == torch.float8_e4m3fn else t.fill_(float("nan"))
            got = call(variant.options())
            for i, (a, b) in enumerate(zip(got, want)):
                assert_same_bits(a, b, f"{ctx}: result {i} vs split_k")
    torch.cuda.synchronize()
    assert_storage_unchanged(before, inp)
    # The float64 oracle on sampled tokens.
    updated, output = _normed(inp, attnres.Options(topology="persistent"))
    idx = sample_tokens(T, seed=T + N).cuda()
    ref = reference.attn_res(inp.layer_residual[idx], inp.block_residual[:, idx], inp.res_weight, inp.rms_weight,
                             inp.rms_eps, layer_residual_add=inp.add[idx], layer_residual_add2=inp.add2[idx],
                             norm_weight=inp.norm_weight, norm_eps=inp.norm_eps)
    check_rows(updated[idx], ref.updated, f"T={T} N={N} H={H}: updated vs the oracle")
    check_rows(output[idx], ref.output, f"T={T} N={N} H={H}: output vs the oracle")


def test_two_addends_with_the_snapshot_write_and_in_place():
    T, N, H = 300, 5, 7168
    inp = _inputs(T, N, H, seed=5)
    persistent = attnres.Options(topology="persistent")
    before = inp.storage_snapshot()
    want = _normed(inp, SPLIT_K)
    slot = inp.spare_slot
    updated, output = _normed(inp, persistent, snapshot_slot=slot)
    torch.cuda.synchronize()
    assert_storage_unchanged(before, inp, except_bank_row=slot, expected_row=updated)
    assert_same_bits(updated, want[0], "snapshot write: updated")
    assert_same_bits(output, want[1], "snapshot write: output")
    prefix = inp.layer_residual.clone()
    updated, output = attnres.attn_res_add_rmsnorm(prefix, inp.add, inp.block_residual, inp.res_weight,
                                                   inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                                   layer_residual_add2=inp.add2, out=(prefix, None),
                                                   options=persistent)
    assert updated.data_ptr() == prefix.data_ptr()
    assert_same_bits(prefix, want[0], "in place: updated")
    assert_same_bits(output, want[1], "in place: output")
