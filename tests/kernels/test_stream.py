"""The streaming single_cta (all CUDA-only, skipped elsewhere): min(T, resident) blocks loop over the tokens,
each prefetching its next token's rows into shared memory while it reduces the current one
(cpp/src/cuda/attn_res_stream.cuh; docs/ops/common.md).

A token's bits must not depend on how the tokens are spread over the blocks: checked against split_k (the
reference order) and the float64 oracle at T below, at and above the grid (a block runs 1, 2 or 3+ tokens;
132 SMs on the H200), N = 1..4 (single_cta's buckets 2 and 4), H from a partial warp to 8192 (single_cta's
limit), with two addends, the tap and the snapshot write, and with the knob forcing streaming at every T.
Every output is poisoned (NaN) before it is read back from a second call, and the inputs' bytes must be
unchanged. Also: CUDA-graph replay equals the eager call, and the release of dependents right after the wait
(the PDL chains of tests/kernels/test_pdl_release.py run this kernel as their reader).
"""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import _stream_tuning as stream, reference
from attnres.graphs import capture
from conftest import requires_cuda
from helpers import assert_same_bits, assert_storage_unchanged
from test_persistent import check_rows, gpu_inputs, sample_tokens

pytestmark = [requires_cuda, pytest.mark.gpu]

BF16 = torch.bfloat16


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _inputs(T: int, N: int, H: int, seed: int, layout: str = "snapshot_major"):
    inp = gpu_inputs(T, N, H, layout=layout, add=True, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 7)
    inp.add2 = (torch.randn(T, H, generator=g, device="cuda") * 0.5).to(BF16)
    inp.buffers["add2"] = inp.add2
    return inp


def _split_k(inp, tap: bool):
    return attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, inp.res_weight,
                                        inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                        layer_residual_add2=inp.add2, return_mixture=tap,
                                        options=attnres.Options(kernel="split_k"))


def _stream(inp, tap: bool, snapshot_slot: int = -1, min_tokens: int = 0):
    return stream.attn_res_add_rmsnorm(min_tokens, inp.layer_residual, inp.add, inp.block_residual, inp.res_weight,
                                       inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps,
                                       layer_residual_add2=inp.add2, return_mixture=tap, snapshot_slot=snapshot_slot)


def _tokens_grid():
    s = _sms()
    return [1, 5, s - 1, s, s + 1, 2 * s + 3, 1000]


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("H", [200, 4104, 7168, 8192])
def test_stream_equals_split_k_and_the_oracle(N, H):
    s = _sms()
    for T in _tokens_grid():
        for min_tokens in ((0, stream.ALWAYS) if T <= s else (0,)):
            ctx = f"T={T} N={N} H={H} min_tokens={min_tokens}"
            p = stream.plan(min_tokens, tokens=T, candidates=N, hidden=H, add2=True)
            assert p.kernel == "single_cta" and (p.smem_bytes > 0) == (T > s or min_tokens == stream.ALWAYS), (ctx, p)
            inp = _inputs(T, N, H, seed=T * 1009 + N * 31 + H)
            before = inp.storage_snapshot()
            want = [t.clone() for t in _split_k(inp, tap=True)]
            got = _stream(inp, tap=True, min_tokens=min_tokens)
            torch.cuda.synchronize()
            assert_storage_unchanged(before, inp)
            for name, a, b in zip(("updated", "output", "mixture"), got, want):
                assert_same_bits(a, b, f"{ctx}: {name} vs split_k")
            tokens = sample_tokens(T, seed=T + N)
            idx = tokens.cuda()
            ref = reference.attn_res(inp.layer_residual[idx], inp.block_residual[:, idx], inp.res_weight,
                                     inp.rms_weight, inp.rms_eps, layer_residual_add=inp.add[idx],
                                     layer_residual_add2=inp.add2[idx], norm_weight=inp.norm_weight,
                                     norm_eps=inp.norm_eps)
            check_rows(got[1][idx], ref.output, f"{ctx}: output vs oracle")
            # The kernel's own outputs poisoned, then a second call: every byte written again, the same bits.
            kept = [t.clone() for t in got]
            for t in got:
                t.fill_(float("nan"))
            again = _stream(inp, tap=True, min_tokens=min_tokens)
            for name, a, b in zip(("updated", "output", "mixture"), again, kept):
                assert_same_bits(a, b, f"{ctx}: {name}, second call")


@pytest.mark.parametrize("layout", ["snapshot_major", "token_major"])
def test_stream_writes_the_snapshot_row_and_nothing_else(layout):
    T, N, H = 2 * _sms() + 3, 4, 7168
    inp = _inputs(T, N, H, seed=11, layout=layout)
    slot = inp.spare_slot
    before = inp.storage_snapshot()
    updated, output, _ = _stream(inp, tap=False, snapshot_slot=slot)
    torch.cuda.synchronize()
    assert_storage_unchanged(before, inp, except_bank_row=slot, expected_row=updated)
    want = _split_k(inp, tap=False)
    assert_same_bits(output, want[1], "output vs split_k")
    assert_same_bits(updated, want[0], "updated vs split_k")


def test_stream_runs_every_op_on_the_plan():
    """attn_res (mixture + fp32 diagnostics) and attn_res_rmsnorm stream on single_cta at T > SMs too: the
    plan says so, and the results are split_k's bits (the full grid: tests/kernels/test_kernel_bits.py at T = 300)."""
    T, N, H = 3 * _sms() + 1, 3, 7168
    inp = _inputs(T, N, H, seed=3)
    single = attnres.Options(kernel="single_cta")
    ref = attnres.Options(kernel="split_k")
    for op, flags in (("attn_res", {}), ("attn_res_rmsnorm", {}), ("attn_res_add_rmsnorm", {"add": True})):
        p = attnres.plan(op, tokens=T, candidates=N, hidden=H, device="cuda", options=single, **flags)
        assert p.kernel == "single_cta" and p.smem_bytes > 0, (op, p)
    w = (inp.res_weight, inp.rms_weight)
    got = attnres.attn_res(inp.layer_residual, inp.block_residual, *w, inp.rms_eps, options=single)
    want = attnres.attn_res(inp.layer_residual, inp.block_residual, *w, inp.rms_eps, options=ref)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_same_bits(a, b, f"attn_res output {i}")
    w = (*w, inp.norm_weight, inp.rms_eps, inp.norm_eps)
    got = attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, return_mixture=True, options=single)
    want = attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, return_mixture=True, options=ref)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_same_bits(a, b, f"attn_res_rmsnorm output {i}")


def test_stream_graph_replay_equals_eager():
    T, N, H = 1000, 4, 7168
    inp = _inputs(T, N, H, seed=5)
    graph, out = capture(lambda: _stream(inp, tap=True)[1])
    for step in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + step)
        inp.layer_residual.copy_(torch.randn(T, H, generator=g, device="cuda").to(BF16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits(out, _split_k(inp, tap=False)[1], f"replay {step} vs split_k eager")


@pytest.mark.parametrize("N,buffers", [(1, 2), (1, 3), (1, 4), (2, 2), (2, 3), (2, 4), (3, 3), (4, 2), (4, 3)])
def test_every_buffer_count_gives_split_k_bits(N, buffers):
    """The token buffers (1..3 tokens in flight per block) change no bit, in every mode of both buckets: attn_res with
    its diagnostics (with and without the addend), attn_res_rmsnorm, one and two addends with the tap and the
    snapshot write, the FP8 epilogue (both scale kinds: the H100 streams N = 1 without an addend on four buffers), and
    the prefix updated in place; a block runs 1 to 8 tokens (T past the grid by 1, 3 and ~7 rounds); every output
    poisoned first."""
    s, H = _sms(), 7168
    opts = stream.StreamOptions(0, "single_cta", buffers=buffers)
    ref = attnres.Options(kernel="split_k")
    for T in (s + 1, 2 * s + 3, 1000):
        ctx = f"T={T} N={N} buffers={buffers}"
        p = stream.plan(0, tokens=T, candidates=N, hidden=H, add=True, buffers=buffers)
        assert p.route == "stream" and p.slots == buffers, (ctx, p)
        inp = _inputs(T, N, H, seed=T * 13 + N + 100 * buffers)
        w = (inp.res_weight, inp.rms_weight)
        wn = (*w, inp.norm_weight, inp.rms_eps, inp.norm_eps)
        calls = {
            "attn_res": lambda o: attnres.attn_res(inp.layer_residual, inp.block_residual, *w, inp.rms_eps, options=o),
            "attn_res add": lambda o: attnres.attn_res(inp.layer_residual, inp.block_residual, *w, inp.rms_eps,
                                                       layer_residual_add=inp.add, options=o),
            "attn_res_rmsnorm": lambda o: attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *wn,
                                                                   return_mixture=True, options=o),
            "add2 tap": lambda o: attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *wn,
                                                               layer_residual_add2=inp.add2, return_mixture=True,
                                                               options=o),
            "attn_res_rmsnorm fp8 per_token": lambda o: attnres.attn_res_rmsnorm(
                inp.layer_residual, inp.block_residual, *wn, fp8="per_token", options=o),
            "add fp8 block128": lambda o: attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual,
                                                                       *wn, fp8="block128", options=o),
        }
        before = inp.storage_snapshot()
        for name, call in calls.items():
            want = [t.clone() for t in call(ref)]
            got = call(opts)
            for t in got:
                t.view(torch.uint8).fill_(0x7F) if t.dtype == torch.float8_e4m3fn else t.fill_(float("nan"))
            got = call(opts)
            for i, (a, b) in enumerate(zip(got, want)):
                assert_same_bits(a, b, f"{ctx}: {name} output {i} vs split_k")
        torch.cuda.synchronize()
        assert_storage_unchanged(before, inp)
        # The snapshot write: the (updated) prefix into the spare bank row, nothing else written.
        slot = inp.spare_slot
        want = _split_k(inp, tap=False)
        updated, output = attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *wn,
                                                       layer_residual_add2=inp.add2, snapshot_slot=slot, options=opts)
        torch.cuda.synchronize()
        assert_storage_unchanged(before, inp, except_bank_row=slot, expected_row=updated)
        assert_same_bits(output, want[1], f"{ctx}: snapshot write, output")
        # In place, as the engines call it: out=(layer_residual, None) holds updated afterwards.
        prefix = inp.layer_residual.clone()
        want = attnres.attn_res_add_rmsnorm(prefix.clone(), inp.add, inp.block_residual, *wn, options=ref)
        updated, output = attnres.attn_res_add_rmsnorm(prefix, inp.add, inp.block_residual, *wn,
                                                       out=(prefix, None), options=opts)
        assert updated.data_ptr() == prefix.data_ptr(), ctx
        assert_same_bits(prefix, want[0], f"{ctx}: in place, updated")
        assert_same_bits(output, want[1], f"{ctx}: in place, output")


@pytest.mark.parametrize("mode", ["per_token", "block128"])
@pytest.mark.parametrize("H", [1152, 4608, 7168, 8192])
def test_fp8_epilogue_gives_split_k_codes_and_scales(mode, H):
    """The FP8 instances: the codes and scales of split_k's FP8 call, bit for bit (so those of attnres.fp8.quantize
    of the bf16 output), and the same bf16 output, in every norm mode (attn_res_rmsnorm, one addend, two), both
    buckets, power-of-two scales or not, a block running 1, 2 or 3+ tokens. block128 streams only where the
    128-column groups align with split_k's chunks (H = 7168, 8192: chunks of 128 vectors); at H = 1152 and 4608
    (chunks of 72 and 116) the plan keeps single_cta on its per-token launch, with the same bits. Outputs poisoned
    first, inputs unchanged."""
    s = _sms()
    aligned = H in (7168, 8192)
    for N, T, min_tokens in ((1, s + 1, 0), (2, 2 * s + 3, 0), (3, 5, stream.ALWAYS), (4, s + 7, 0)):
        inp = _inputs(T, N, H, seed=T * 7 + N + H)
        w = (inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps, inp.norm_eps)
        calls = {
            "norm": lambda o, p: attnres.attn_res_rmsnorm(inp.layer_residual, inp.block_residual, *w, fp8=mode,
                                                          fp8_pow2_scales=p, options=o),
            "add": lambda o, p: attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w,
                                                             fp8=mode, fp8_pow2_scales=p, options=o),
            "add2": lambda o, p: attnres.attn_res_add_rmsnorm(inp.layer_residual, inp.add, inp.block_residual, *w,
                                                              layer_residual_add2=inp.add2, fp8=mode,
                                                              fp8_pow2_scales=p, options=o),
        }
        opts = stream.StreamOptions(min_tokens, "single_cta")
        ref = attnres.Options(kernel="split_k")
        before = inp.storage_snapshot()
        for name, call in calls.items():
            planned = attnres.plan("attn_res_rmsnorm" if name == "norm" else "attn_res_add_rmsnorm", tokens=T,
                                   candidates=N, hidden=H, device="cuda", add=name != "norm", add2=name == "add2",
                                   fp8=mode, options=opts)
            ctx = f"{mode} H={H} N={N} T={T} {name}"
            assert planned.kernel == "single_cta", (ctx, planned)
            assert (planned.route == "stream") == (mode == "per_token" or aligned), (ctx, planned)
            for pow2 in (False, True):
                want = [t.clone() for t in call(ref, pow2)]
                got = call(opts, pow2)
                for t in got:
                    t.view(torch.uint8).fill_(0x7F) if t.dtype == torch.float8_e4m3fn else t.fill_(float("nan"))
                got = call(opts, pow2)
                for i, (a, b) in enumerate(zip(got, want)):
                    assert_same_bits(a, b, f"{ctx} pow2={pow2}: result {i} vs split_k")
        torch.cuda.synchronize()
        assert_storage_unchanged(before, inp)
