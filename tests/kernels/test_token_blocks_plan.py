"""The plan of the token-block single_cta (no GPU needed: the described H100 and H200). One block per token,
several per SM (cpp/src/cuda/attn_res_blocks.cuh): the automatic choice on the H100 from T = 4096 where it
measured faster (plan_tuning.hpp automatic_token_blocks_min_tokens), never on the H200 (not measured), never
automatically with FP8 output (its FP8 instances are not measured); the benchmark-only knobs move the bound for
single_cta (FP8 calls included) and take the exact N = 3 instance."""

from __future__ import annotations

import pytest

import attnres
from attnres import _C, _stream_tuning as stream
from attnres.planning import device_info, plan_info

H = 7168
FROM = 4096

# (op, addends, N) where the H100 takes the token-block kernel from T = 4096 (the measured table).
TAKEN = {("attn_res_add_rmsnorm", 1): (1, 2, 3), ("attn_res_add_rmsnorm", 2): (1, 2),
         ("attn_res", 0): (1, 2), ("attn_res_rmsnorm", 0): (2, 3, 4), ("attn_res", 1): (1, 2),
         ("attn_res", 2): (1, 2)}


def _plan(op, T, N, addends, device="h100", hidden=H, fp8=None, options=None):
    return attnres.plan(op, tokens=T, candidates=N, hidden=hidden, device=device, add=addends >= 1,
                        add2=addends == 2, fp8=fp8, options=options or attnres.Options())


@pytest.mark.parametrize("op,addends", sorted(TAKEN))
@pytest.mark.parametrize("N", [1, 2, 3, 4, 5])
def test_the_h100_takes_it_from_4096_where_measured(op, addends, N):
    taken = N in TAKEN[(op, addends)]
    for T in (FROM - 1, FROM, 16384):
        p = _plan(op, T, N, addends)
        ctx = (op, addends, N, T, p)
        assert (p.route == "token_blocks") == (taken and T >= FROM), ctx
        if p.route == "token_blocks":
            # ceil(7 chunks / 4) groups of 128 threads, 4 vectors each; no shared memory; 3 blocks per SM at N <= 2.
            assert p.kernel == "single_cta" and p.threads == 256 and p.vectors == 4 and p.smem_bytes == 0, ctx
            assert p.blocks_per_sm == (3 if N <= 2 else 2) and p.cluster == 1, ctx
            assert p.max_candidates == (2 if N <= 2 else 4), ctx


@pytest.mark.parametrize("op,addends", sorted(TAKEN))
def test_never_on_the_h200_nor_with_fp8_nor_at_small_h(op, addends):
    for N in (1, 2, 3, 4):
        assert _plan(op, 16384, N, addends, device="h200").route != "token_blocks", (op, N)
        assert _plan(op, 16384, N, addends, hidden=4096).route != "token_blocks", (op, N)
        if op != "attn_res":
            for fp8 in ("per_token", "block128"):
                p = _plan(op, 16384, N, addends, fp8=fp8, options=attnres.Options(kernel="single_cta"))
                assert p.route == "stream", (op, N, fp8, p)


def test_forced_split_k_and_persistent_stay():
    p = _plan("attn_res_add_rmsnorm", 16384, 2, 1, options=attnres.Options(kernel="split_k"))
    assert p.kernel == "split_k" and p.route == "per_token", p
    p = _plan("attn_res_add_rmsnorm", 16384, 2, 1, options=attnres.Options(topology="persistent"))
    assert p.route == "persistent", p


@pytest.mark.parametrize("hidden,threads", [(64, 128), (1024, 128), (4096, 128), (4104, 256), (7168, 256),
                                            (8192, 256)])
def test_the_knob_moves_the_bound_and_the_block_follows_h(hidden, threads):
    """split_k_cluster(H) chunks, four per group of 128 threads; any device, any T from the knob's on."""
    for device in ("h100", "h200"):
        for N in (1, 4):
            p = stream.plan(stream.NEVER, tokens=1, candidates=N, hidden=hidden, device=device,
                            blocks_min_tokens=stream.ALWAYS)
            assert p.route == "token_blocks" and p.threads == threads and p.vectors == 4, (device, N, p)
            assert stream.plan(stream.NEVER, tokens=499, candidates=N, hidden=hidden, device=device,
                               blocks_min_tokens=500).route == "per_token"
            assert stream.plan(stream.NEVER, tokens=500, candidates=N, hidden=hidden, device=device,
                               blocks_min_tokens=500).route == "token_blocks"
    # single_cta's N limit holds: N = 5 is declined forced, split_k automatic.
    assert not stream.plan(stream.NEVER, tokens=1, candidates=5, hidden=hidden, device="h100",
                           blocks_min_tokens=stream.ALWAYS).accepted


def test_the_knob_is_validated():
    with pytest.raises(attnres.ArgumentError, match=r"^attn_res_add_rmsnorm: options\.token_blocks_min_tokens must be "
                                                    r">= 0 \(0: the plan's bound\), got -1"):
        stream.plan(0, tokens=1, candidates=2, hidden=H, device="h100", blocks_min_tokens=-1)
    with pytest.raises(attnres.ArgumentError, match="token_blocks_min_tokens must be an int"):
        stream.StreamOptions(0, blocks_min_tokens=1.5)
    assert "token_blocks" in _C.Route.__members__


def test_the_exact_n3_knob_takes_its_instance_at_n3_only():
    """token_blocks_exact_n: at N = 3 the instance built for three candidates, three blocks per SM (the bucket's:
    N = 4, two); at every other N, on any other route and in the default plan nothing changes."""
    for device in ("h100", "h200"):
        for N, bucket, blocks in ((1, 2, 3), (2, 2, 3), (3, 4, 2), (4, 4, 2)):
            kw = dict(tokens=8192, candidates=N, hidden=H, device=device, blocks_min_tokens=stream.ALWAYS)
            base, exact = stream.plan(stream.NEVER, **kw), stream.plan(stream.NEVER, blocks_exact_n=True, **kw)
            assert (base.route, base.max_candidates, base.blocks_per_sm) == ("token_blocks", bucket, blocks)
            want = (3, 3) if N == 3 else (bucket, blocks)
            assert (exact.max_candidates, exact.blocks_per_sm) == want, (device, N, exact)
            assert (exact.threads, exact.vectors, exact.smem_bytes) == (base.threads, base.vectors, 0)
    # Another route's plan is the one without the knob; the default options never set it.
    for kernel in ("split_k", "single_cta"):
        kw = dict(tokens=8192, candidates=3, hidden=H, device="h100", kernel=kernel)
        assert stream.plan(stream.NEVER, blocks_exact_n=True, **kw) == stream.plan(stream.NEVER, **kw), kernel
    assert not _C.Options()._token_blocks_exact_n and not attnres.Options().to_c()._token_blocks_exact_n
    with pytest.raises(attnres.ArgumentError, match="token_blocks_exact_n must be a bool"):
        stream.StreamOptions(0, blocks_exact_n=1)


def test_fp8_calls_take_token_blocks_only_through_the_knob():
    """The FP8 instances are not measured: the automatic plan keeps FP8 calls off the token blocks; the knob takes
    them there, block128 only where split_k's chunks are multiples of 16 vectors (H = 7168: 128; H = 4224: 106)."""
    for fp8 in ("per_token", "block128"):
        auto = attnres.plan("attn_res_add_rmsnorm", tokens=8192, candidates=2, hidden=H, device="h100", add=True,
                            fp8=fp8)
        assert auto.route != "token_blocks", auto
        q = _C.PlanQuery()
        q.op, q.tokens, q.candidates, q.hidden, q.add = _C.AttnResOp.attn_res_add_rmsnorm, 8192, 2, H, True
        q.fp8 = getattr(_C.Fp8Scales, fp8)
        knob = stream.StreamOptions(stream.NEVER, "single_cta", blocks_min_tokens=stream.ALWAYS).to_c()
        forced = plan_info(_C.plan_query(q, device_info("h100"), knob))
        assert forced.route == "token_blocks" and forced.blocks_per_sm == 3, forced
        q.hidden = 4224
        other = plan_info(_C.plan_query(q, device_info("h100"), knob))
        assert other.accepted and (other.route == "token_blocks") == (fp8 == "per_token"), (fp8, other)
