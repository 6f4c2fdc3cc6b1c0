"""The plan of the streaming single_cta (no GPU needed: the described H200, 132 SMs, 227 KB of shared memory
per block). single_cta streams once there are more tokens than SMs (or from the benchmark-only knob's T on),
for the bf16 output, where the two prefetch buffers fit the block's shared memory; the automatic choice is
unchanged by the knob's presence."""

from __future__ import annotations

import pytest

import attnres
from attnres import _stream_tuning as stream

SMS = 132
OPTIN = 232448


def _bytes(bucket: int, add: bool, add2: bool, lanes: int) -> int:
    slots = bucket + add + add2  # bank rows 0..bucket-2, the prefix, the addends
    return 2 * slots * lanes * 16  # two buffers, a 16-byte vector per lane (the one-block layout's threads)


@pytest.mark.parametrize("N,bucket", [(1, 2), (2, 2), (3, 4), (4, 4)])
@pytest.mark.parametrize("add,add2", [(False, False), (True, False), (True, True)])
def test_single_cta_streams_past_one_token_per_sm(N, bucket, add, add2):
    H = 7168
    for T, streams in ((1, False), (SMS, False), (SMS + 1, True), (16384, True)):
        p = stream.plan(0, tokens=T, candidates=N, hidden=H, add=add, add2=add2, device="h200")
        # Streaming: two of the one-block layout's 896 lanes (vectors) per thread.
        assert p.kernel == "single_cta" and p.threads == (448 if streams else 896), p
        assert p.vectors == (2 if streams else 0), p
        assert p.smem_bytes == (_bytes(bucket, add, add2, 896) if streams else 0), (T, p)
    # The public plan reports the same (attnres.plan, kernel forced).
    op = "attn_res_add_rmsnorm" if add else "attn_res_rmsnorm"
    p = attnres.plan(op, tokens=SMS + 1, candidates=N, hidden=H, device="h200", add=add, add2=add2,
                     options=attnres.Options(kernel="single_cta"))
    assert p.smem_bytes == _bytes(bucket, add, add2, 896), p


@pytest.mark.parametrize("H,lanes,threads", [(768, 96, 64), (1024, 128, 64), (6912, 896, 448), (7176, 1024, 512)])
def test_the_streaming_block_is_half_the_one_block_layout(H, lanes, threads):
    """Whole warps of two lanes per thread: an odd count of the layout's warps gets one more warp of lanes (that
    owns no vector), and the buffers hold every lane."""
    p = stream.plan(stream.ALWAYS, tokens=1000, candidates=2, hidden=H, add=True, device="h200")
    assert p.kernel == "single_cta" and p.threads == threads and p.vectors == 2, p
    assert p.smem_bytes == _bytes(2, True, False, 2 * threads), p
    assert attnres.plan("attn_res_add_rmsnorm", tokens=1, candidates=2, hidden=H, device="h200", add=True,
                        options=attnres.Options(kernel="single_cta")).threads == lanes


def test_the_knob_moves_the_bound():
    kw = dict(candidates=4, hidden=7168, add2=True, device="h200")
    assert stream.plan(stream.ALWAYS, tokens=1, **kw).smem_bytes > 0
    assert stream.plan(stream.NEVER, tokens=16384, **kw).smem_bytes == 0
    assert stream.plan(500, tokens=499, **kw).smem_bytes == 0
    assert stream.plan(500, tokens=500, **kw).smem_bytes > 0


def test_no_streaming_for_unaligned_block128_groups_or_buffers_that_do_not_fit():
    single_cta = attnres.Options(kernel="single_cta")
    for fp8 in (None, "per_token", "block128"):
        p = attnres.plan("attn_res_add_rmsnorm", tokens=1000, candidates=4, hidden=7168, device="h200", add=True,
                         fp8=fp8, options=single_cta)
        assert p.kernel == "single_cta" and p.route == "stream" and p.smem_bytes > 0, (fp8, p)
    # H = 4608: split_k's chunks of 116 vectors split 128-column groups; per_token streams, block128 does not.
    p = attnres.plan("attn_res_add_rmsnorm", tokens=1000, candidates=4, hidden=4608, device="h200", add=True,
                     fp8="per_token", options=single_cta)
    assert p.route == "stream", p
    p = attnres.plan("attn_res_add_rmsnorm", tokens=1000, candidates=4, hidden=4608, device="h200", add=True,
                     fp8="block128", options=single_cta)
    assert p.kernel == "single_cta" and p.route == "per_token" and p.smem_bytes == 0, p
    # H = 8192 (1024 lanes, 512 threads), bucket 4, two addends: 2 x 6 x 1024 x 16 = 196,608 B + the static arrays
    # fit.
    p = stream.plan(0, tokens=1000, candidates=4, hidden=8192, add2=True, device="h200")
    assert p.smem_bytes == 196608 and p.threads == 512, p
    # A device with less shared memory per block: the buffers do not fit, single_cta runs one token per block.
    small = {"cc_major": 9, "cc_minor": 0, "sm_count": SMS, "shared_memory_per_block_optin": 100 * 1024}
    p = stream.plan(0, tokens=1000, candidates=4, hidden=8192, add2=True, device=small)
    assert p.kernel == "single_cta" and p.smem_bytes == 0, p


def test_split_k_and_persistent_plans_are_not_streamed():
    for kernel in ("split_k", "persistent"):
        p = stream.plan(stream.ALWAYS, tokens=1000, candidates=2, hidden=7168, device="h200", kernel=kernel)
        assert p.kernel == kernel, p
        if kernel == "split_k":
            assert p.smem_bytes == 0, p


@pytest.mark.parametrize("bad", [-1, -(1 << 40)])
def test_the_knob_is_validated(bad):
    with pytest.raises(attnres.ArgumentError,
                       match=r"^attn_res_add_rmsnorm: options\.stream_min_tokens must be >= 0 \(0: the plan's bound\), got -"):
        stream.plan(bad, tokens=300, candidates=2, hidden=7168, device="h200")
    with pytest.raises(attnres.ArgumentError, match="stream_min_tokens must be an int"):
        stream.StreamOptions(1.5)


@pytest.mark.parametrize("buffers", [2, 3, 4])
@pytest.mark.parametrize("N", [1, 2])
@pytest.mark.parametrize("add,add2", [(False, False), (True, False), (True, True)])
def test_the_buffers_knob_sizes_the_ring_of_tokens(buffers, N, add, add2):
    """Bucket 2 is built with 2, 3 and 4 token buffers: the plan reports the count as slots and sizes the shared
    memory for it, or runs one token per block where the buffers do not fit (4 x 4 rows of 14 KB with two
    addends); 0 keeps the plan's count."""
    kw = dict(tokens=4096, candidates=N, hidden=7168, add=add, add2=add2, device="h200")
    p = stream.plan(0, buffers=buffers, **kw)
    bytes_ = _bytes(2, add, add2, 896) // 2 * buffers
    if bytes_ + 4096 > OPTIN:
        assert p.route == "per_token" and p.smem_bytes == 0 and p.slots == 0, p
    else:
        assert p.route == "stream" and p.slots == buffers and p.smem_bytes == bytes_, p
    default = stream.plan(0, **kw)
    assert default.route == "stream" and default.smem_bytes == _bytes(2, add, add2, 896) // 2 * default.slots


@pytest.mark.parametrize("bad", [1, 5, -1, 1 << 20])
def test_buffers_validated(bad):
    with pytest.raises(attnres.ArgumentError,
                       match=rf"^attn_res_add_rmsnorm: options\.stream_buffers must be 0 \(the plan's choice\) or in "
                             rf"\[2, 4\], got {bad}$"):
        stream.plan(0, tokens=300, candidates=2, hidden=7168, device="h200", buffers=bad)
    with pytest.raises(attnres.ArgumentError, match="stream_buffers must be an int"):
        stream.StreamOptions(0, buffers=2.0)


def test_buffers_unbuilt():
    """Bucket 4 (N = 3, 4) is built with two and three buffers."""
    assert stream.plan(0, tokens=4096, candidates=3, hidden=7168, device="h200", buffers=3).slots == 3
    with pytest.raises(attnres.ArgumentError,
                       match=r"^attn_res_add_rmsnorm: options\.stream_buffers = 4: not built for N bucket 4$"):
        stream.plan(0, tokens=4096, candidates=3, hidden=7168, device="h200", buffers=4)


@pytest.mark.parametrize("op,flags", [("attn_res_add_rmsnorm", {"add": True}),
                                      ("attn_res_add_rmsnorm", {"add": True, "add2": True}),
                                      ("attn_res_rmsnorm", {}), ("attn_res", {})])
def test_automatic_takes_the_streaming_single_cta_where_it_was_measured_faster(op, flags):
    """N <= 2, T >= 256, H > 4096 (one block fills an SM's registers): single_cta streaming, ahead of the
    persistent kernel too, with the FP8 epilogue as without (block128 only where its 128-column groups align with
    split_k's chunks); split_k below T = 256, for N >= 3 and at H <= 4096."""
    def plan(T, N, H, **kw):
        return attnres.plan(op, tokens=T, candidates=N, hidden=H, device="h200", **flags, **kw)
    for T in (256, 1000, 4096, 16384):
        for N in (1, 2):
            p = plan(T, N, 7168)
            assert p.kernel == "single_cta" and p.smem_bytes > 0, (T, N, p)
        assert plan(T, 3, 7168).kernel in ("split_k", "persistent")
        assert plan(T, 2, 4096).kernel in ("split_k", "persistent")
    assert plan(255, 2, 7168).kernel == "split_k"
    if op != "attn_res":
        for fp8 in ("per_token", "block128"):
            p = plan(4096, 2, 7168, fp8=fp8)
            assert p.route == "stream" and p.smem_bytes == plan(4096, 2, 7168).smem_bytes, p
        assert plan(4096, 2, 4608, fp8="per_token").route == "stream"
        p = plan(4096, 2, 4608, fp8="block128")  # chunks of 116 vectors: the groups straddle them
        assert p.kernel in ("split_k", "persistent") and p.route != "stream", p
    # N = 9 keeps the persistent kernel's rule (one addend, T >= 512 at H = 7168).
    if flags == {"add": True}:
        assert plan(4096, 9, 7168).kernel == "persistent"


# The measured thresholds by GPU and op (None: never), N = 1..16 (cpp/src/plan_tuning.hpp).
MEASURED = {
    ("h200", True): {N: None if N > 10 else {3: 2048, 5: 128, 9: 512}.get(N, 4096 if N <= 4 else 256)
                     for N in range(1, 17)},
    ("h200", False): {N: None if N > 13 else {1: 4096, 2: 4096, 4: 512, 5: 128, 6: 128, 9: 512}.get(N, 256)
                      for N in range(1, 17)},
    # The H100's: split_k's exact-N instances beat the persistent kernel at every measured N and T.
    ("h100", True): {N: None for N in range(1, 17)},
    ("h100", False): {N: None for N in range(1, 17)},
}
# Two addends (the H200's grid not measured, the H100's lost to split_k: never).
MEASURED_ADD2 = {"h200": {}, "h100": {}}


@pytest.mark.parametrize("gpu", ["h200", "h100"])
@pytest.mark.parametrize("H", [7168, 4096])
@pytest.mark.parametrize("op", ["attn_res_add_rmsnorm", "attn_res_rmsnorm"], ids=["add", "noadd"])
def test_automatic_takes_the_persistent_kernel_by_n_and_t(H, op, gpu):
    """No addend, one or two, two blocks per SM: persistent from the T its GPU's grid measured for N and the
    addends (at H > 4096; T >= 4096 at H <= 4096), never where that grid never measured it faster or with the tap;
    the streaming single_cta first for N <= 2 at H > 4096 (N <= 4 without the addend on the H100; the token-block
    single_cta at N = 3 with the addend on the H100 from T = 4096). A
    snapshot write changes nothing, and
    attn_res without the fp32 diagnostics (the same addend) takes the same kernel but there."""
    add = op == "attn_res_add_rmsnorm"

    def kernel(T, N, **flags):
        return attnres.plan(op, tokens=T, candidates=N, hidden=H, device=gpu,
                            **({"add": True} if add else {}) | flags).kernel
    big = H > 4096
    for N in range(1, 17):
        measured = MEASURED[gpu, add][N]
        start = None if measured is None else measured if big else 4096
        for T in (1, 127, 128, 255, 256, 511, 512, 1024, 2047, 2048, 4095, 4096, 16384):
            want = "persistent" if start is not None and T >= start else "split_k"
            if N <= (4 if gpu == "h100" and not add else 2) and big and T >= 256:
                want = "single_cta"
            if gpu == "h100" and add and N == 3 and big and T >= 4096:
                want = "single_cta"  # the token-block kernel's table (tests/kernels/test_token_blocks_plan.py)
            assert kernel(T, N) == want, (H, N, T)
            assert kernel(T, N, snapshot=True) == want, (H, N, T)
            assert kernel(T, N, tap=True) in ("split_k", "single_cta"), (H, N, T)
            if add:
                start2 = MEASURED_ADD2[gpu].get(N)
                start2 = start2 if start2 is None or big else 4096
                want2 = "persistent" if start2 is not None and T >= start2 else "split_k"
                if N <= 2 and big and T >= 256:
                    want2 = "single_cta"
                assert kernel(T, N, add2=True) == want2, (H, N, T)
            mix = attnres.plan("attn_res", tokens=T, candidates=N, hidden=H, device=gpu, add=add)
            # Except the token blocks at N = 3 with the addend, which attn_res does not take (split_k measured ahead
            # for it there, h100_68c355c_token_blocks.txt).
            blocks_only_normed = gpu == "h100" and add and N == 3 and big and T >= 4096
            assert mix.kernel == ("split_k" if blocks_only_normed else want), (H, N, T, mix)
