"""The token-block single_cta (all CUDA-only, skipped elsewhere): one block per token, several resident per SM
(cpp/src/cuda/attn_res_blocks.cuh), taken through the benchmark-only knob at every T here.

A token's bits are split_k's (the reference order): checked in every mode (attn_res with its fp32 diagnostics,
with and without addends; attn_res_rmsnorm with the tap; one and two addends with the tap), N = 1..4 (single_cta's
buckets 2 and 4), H from one group of 128 threads with a partial chunk to two whole groups (C = 1 .. 8 chunks),
T from 1 to past several blocks per SM, against the float64 oracle, with the snapshot write, the prefix updated in
place, non-finite and zero rows, and under CUDA-graph replay. Every output is poisoned before a second call, and
the inputs' bytes must be unchanged. The PDL chains of tests/kernels/test_pdl_release.py run it as a reader and a
filler."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import _C, _stream_tuning as stream, fp8, reference
from attnres.graphs import capture
from attnres.planning import plan_info
from conftest import requires_cuda
from helpers import assert_same_bits, assert_storage_unchanged
from test_persistent import check_rows, sample_tokens
from test_stream import _inputs

pytestmark = [requires_cuda, pytest.mark.gpu]

BF16 = torch.bfloat16
BLOCKS = stream.StreamOptions(stream.NEVER, "single_cta", blocks_min_tokens=stream.ALWAYS)
EXACT = stream.StreamOptions(stream.NEVER, "single_cta", blocks_min_tokens=stream.ALWAYS, blocks_exact_n=True)
SPLIT_K = attnres.Options(kernel="split_k")


def _calls(inp):
    w = (inp.res_weight, inp.rms_weight)
    wn = (*w, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    lr, bank = inp.layer_residual, inp.block_residual
    return {
        "attn_res": lambda o: attnres.attn_res(lr, bank, *w, inp.rms_eps, options=o),
        "attn_res add": lambda o: attnres.attn_res(lr, bank, *w, inp.rms_eps, layer_residual_add=inp.add, options=o),
        "attn_res add2": lambda o: attnres.attn_res(lr, bank, *w, inp.rms_eps, layer_residual_add=inp.add,
                                                    layer_residual_add2=inp.add2, diagnostics=False, options=o),
        "attn_res_rmsnorm": lambda o: attnres.attn_res_rmsnorm(lr, bank, *wn, return_mixture=True, options=o),
        "add tap": lambda o: attnres.attn_res_add_rmsnorm(lr, inp.add, bank, *wn, return_mixture=True, options=o),
        "add2 tap": lambda o: attnres.attn_res_add_rmsnorm(lr, inp.add, bank, *wn, layer_residual_add2=inp.add2,
                                                           return_mixture=True, options=o),
    }


def _every_call_gives_split_k_bits(inp, ctx: str, blocks=BLOCKS):
    before = inp.storage_snapshot()
    for name, call in _calls(inp).items():
        want = [t.clone() for t in call(SPLIT_K)]
        got = call(blocks)
        for t in got:
            t.fill_(float("nan"))
        got = call(blocks)
        assert len(got) == len(want), (ctx, name)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_bits(a, b, f"{ctx}: {name} output {i} vs split_k")
    torch.cuda.synchronize()
    assert_storage_unchanged(before, inp)


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("H", [200, 4104, 7168, 8192])
def test_token_blocks_equal_split_k_and_the_oracle(N, H):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for T in (1, 5, 3 * sms + 7, 1000):
        ctx = f"T={T} N={N} H={H}"
        p = stream.plan(stream.NEVER, tokens=T, candidates=N, hidden=H, add2=True, blocks_min_tokens=stream.ALWAYS)
        assert p.kernel == "single_cta" and p.route == "token_blocks", (ctx, p)
        inp = _inputs(T, N, H, seed=T * 1009 + N * 31 + H)
        _every_call_gives_split_k_bits(inp, ctx)
        got = stream.attn_res_add_rmsnorm(stream.NEVER, inp.layer_residual, inp.add, inp.block_residual,
                                          inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                          layer_residual_add2=inp.add2, blocks_min_tokens=stream.ALWAYS)
        idx = sample_tokens(T, seed=T + N).cuda()
        ref = reference.attn_res(inp.layer_residual[idx], inp.block_residual[:, idx], inp.res_weight,
                                 inp.rms_weight, inp.rms_eps, layer_residual_add=inp.add[idx],
                                 layer_residual_add2=inp.add2[idx], norm_weight=inp.norm_weight,
                                 norm_eps=inp.norm_eps)
        check_rows(got[1][idx], ref.output, f"{ctx}: output vs oracle")


@pytest.mark.parametrize("H", [200, 1160, 7168, 8192])
def test_exact_n3_instance_equals_split_k(H):
    """The instance built for exactly N = 3 (three blocks per SM, each slot's scores reduced on their own; the knob
    token_blocks_exact_n): split_k's bits in every mode, also for non-finite and zero rows, and it is what runs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for T in (1, 4 * sms + 3):
        ctx = f"exact N=3 T={T} H={H}"
        p = stream.plan(stream.NEVER, tokens=T, candidates=3, hidden=H, blocks_min_tokens=stream.ALWAYS,
                        blocks_exact_n=True)
        assert (p.route, p.max_candidates, p.blocks_per_sm) == ("token_blocks", 3, 3), (ctx, p)
        inp = _inputs(T, 3, H, seed=T * 7 + H)
        if T > 20:
            inp.layer_residual[3].zero_()
            inp.add[9, 5] = float("nan")
            inp.block_residual[0, 13, 7] = float("-inf")
            inp.block_residual[1, 17].zero_()
        _every_call_gives_split_k_bits(inp, ctx, EXACT)
        launched = plan_info(_C._last_launch()[0])
        assert (launched.route, launched.max_candidates, launched.blocks_per_sm) == ("token_blocks", 3, 3), ctx


@pytest.mark.parametrize("mode", ["per_token", "block128"])
@pytest.mark.parametrize("H", [1024, 4224, 7168])
def test_fp8_instances_give_the_quantized_split_k_output(mode, H):
    """The FP8 instances (taken through the knob): the bf16 output is split_k's bit for bit, the codes and scales are
    attnres.fp8.quantize of it, with and without the bf16 output (fp8_only), at every instance N (N = 3 exact too),
    normed modes with zero, one and two addends. block128 needs chunks of a multiple of 16 vectors (H = 4224's are
    not: the plan keeps another kernel there)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    aligned = mode == "per_token" or H != 4224  # split_k's chunks: 128 vectors at H = 1024 and 7168, 106 at 4224
    for N, options in ((1, BLOCKS), (2, BLOCKS), (3, BLOCKS), (3, EXACT), (4, BLOCKS)):
        for T in (1, 3 * sms + 7):
            ctx = f"{mode} H={H} N={N} T={T} exact={options is EXACT}"
            inp = _inputs(T, N, H, seed=T + 17 * N + H)
            w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
            calls = {
                "norm": lambda o, **kw: attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w,
                                                                 options=o, **kw),
                "add": lambda o, **kw: attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual,
                                                                    *w, options=o, **kw),
                "add2": lambda o, **kw: attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual,
                                                                     *w, layer_residual_add2=inp.add2, options=o,
                                                                     **kw),
            }
            for name, call in calls.items():
                want = call(SPLIT_K)
                want = want if isinstance(want, tuple) else (want,)
                got = call(options, fp8=mode)
                launched = plan_info(_C._last_launch()[0])
                assert (launched.route == "token_blocks") == aligned, (ctx, name, launched)
                assert_same_bits(got[-3], want[-1], f"{ctx} {name}: the bf16 output vs split_k")
                rq, rs = fp8.quantize(want[-1], mode)
                assert_same_bits(got[-2], rq, f"{ctx} {name}: codes")
                assert_same_bits(got[-1].contiguous(), rs, f"{ctx} {name}: scales")
                for a, b in zip(got[:-3], want[:-1]):
                    assert_same_bits(a, b, f"{ctx} {name}: updated")
                only = call(options, fp8=mode, fp8_only=True)
                assert_same_bits(only[-2], rq, f"{ctx} {name}: FP8-only codes")
                assert_same_bits(only[-1].contiguous(), rs, f"{ctx} {name}: FP8-only scales")


@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_non_finite_and_zero_rows_give_split_k_bits(N):
    """inf, NaN and all-zero rows in the prefix, the addend and the bank: whatever the softmax and the norm make of
    them, the same bits as split_k (the N = 1 rule included)."""
    T, H = 300, 7168
    inp = _inputs(T, N, H, seed=41 + N)
    inp.layer_residual[3].zero_()
    inp.layer_residual[7, 100] = float("inf")
    inp.add[9, 5] = float("nan")
    inp.add[11].zero_()
    inp.layer_residual[11].zero_()
    if N > 1:
        inp.block_residual[0, 13, 7] = float("-inf")
        inp.block_residual[N - 2, 17].zero_()
    _every_call_gives_split_k_bits(inp, f"non-finite N={N}")


@pytest.mark.parametrize("layout", ["snapshot_major", "token_major"])
@pytest.mark.parametrize("N", [1, 2, 4])
def test_snapshot_write_and_in_place_update(layout, N):
    T, H = 1000, 7168
    inp = _inputs(T, N, H, seed=11 + N, layout=layout)
    wn = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    slot = inp.spare_slot
    before = inp.storage_snapshot()
    want = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *wn,
                                        layer_residual_add2=inp.add2, options=SPLIT_K)
    updated, output = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *wn,
                                                   layer_residual_add2=inp.add2, snapshot_slot=slot, options=BLOCKS)
    torch.cuda.synchronize()
    assert_storage_unchanged(before, inp, except_bank_row=slot, expected_row=updated)
    assert_same_bits(output, want[1], "snapshot write, output")
    assert_same_bits(updated, want[0], "snapshot write, updated")
    # attn_res_rmsnorm's snapshot row is the prefix itself.
    inp2 = _inputs(T, N, H, seed=12 + N, layout=layout)
    before = inp2.storage_snapshot()
    out = attnres.attn_res_rmsnorm(inp2.layer_residual, inp2.block_residual, *wn, snapshot_slot=inp2.spare_slot,
                                   options=BLOCKS)
    torch.cuda.synchronize()
    assert_storage_unchanged(before, inp2, except_bank_row=inp2.spare_slot, expected_row=inp2.layer_residual)
    assert_same_bits(out, attnres.attn_res_rmsnorm(inp2.layer_residual, inp2.block_residual, *wn, options=SPLIT_K),
                     "attn_res_rmsnorm snapshot write, output")
    # In place, as the engines call it: out=(layer_residual, None) holds updated afterwards.
    prefix = inp.layer_residual.clone()
    want = attnres.attn_res_add_rmsnorm(prefix.clone(), inp.add, inp.block_residual, *wn, options=SPLIT_K)
    updated, output = attnres.attn_res_add_rmsnorm(prefix, inp.add, inp.block_residual, *wn, out=(prefix, None),
                                                   options=BLOCKS)
    assert updated.data_ptr() == prefix.data_ptr()
    assert_same_bits(prefix, want[0], "in place, updated")
    assert_same_bits(output, want[1], "in place, output")


def test_the_automatic_choice_runs_it_where_planned():
    """At T = 4096 the plan (the H100's table; elsewhere the knob) and the launch agree: the launch record says
    token_blocks, and the bits are split_k's."""
    T, N, H = 4096, 2, 7168
    inp = _inputs(T, N, H, seed=3)
    p = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=N, hidden=H, device="cuda", add=True)
    wn = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    opts = None if p.route == "token_blocks" else BLOCKS
    got = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *wn, options=opts)
    assert _C._last_launch()[0].route == _C.Route.token_blocks
    want = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *wn, options=SPLIT_K)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_same_bits(a, b, f"output {i}")


def test_graph_replay_equals_eager():
    T, N, H = 1000, 4, 7168
    inp = _inputs(T, N, H, seed=5)
    wn = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    graph, out = capture(lambda: attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *wn,
                                                              options=BLOCKS)[1])
    for step in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + step)
        inp.layer_residual.copy_(torch.randn(T, H, generator=g, device="cuda").to(BF16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *wn, options=SPLIT_K)
        assert_same_bits(out, want[1], f"replay {step} vs split_k eager")
