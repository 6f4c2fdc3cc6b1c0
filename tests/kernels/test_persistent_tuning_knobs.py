"""The persistent kernel's tuning knobs without a GPU (attnres._persistent_tuning): the geometry each variant plans
on a described H200, the ArgumentError of a value out of range through every entry point of the hook (plan and
call, which changes nothing), and the CPU call (the benchmark of the variants: test_bench_persistent_variants.py)."""

from __future__ import annotations

import pytest

import attnres
from attnres import _persistent_tuning as tuning
from helpers import assert_same_bits, assert_storage_unchanged, make_inputs

V = tuning.Variant


def _plan(v, T=16384, N=9, H=7168, add=True):
    return tuning.plan(v, tokens=T, candidates=N, hidden=H, add=add, device="h200")


def test_variant_geometry_on_a_described_h200():
    base = _plan(V("one_block", blocks_per_sm=1))
    assert (base.blocks_per_sm, base.slots, base.passes, base.blocks, base.threads) == (1, 16, 1, 132, 256)
    two = _plan(V("two_blocks", blocks_per_sm=2))
    automatic = _plan(V("default"))
    assert (automatic.blocks_per_sm, automatic.slots, automatic.passes, automatic.blocks) == (2, 8, 2, 264)
    assert (two.blocks_per_sm, two.slots, two.passes, two.blocks, two.threads) == (2, 8, 2, 264, 256)
    assert two.smem_bytes == 768 + 8 * 14336 and two.vectors == base.vectors
    assert _plan(V("two_blocks", blocks_per_sm=2), N=2).passes == 1
    # 11 slots do not fit half the SM: the automatic blocks per SM fall back to one instead of declining.
    assert (_plan(V("spare1", slots=11)).slots, _plan(V("spare1", slots=11)).passes) == (11, 1)
    assert _plan(V("spare1", slots=11)).blocks_per_sm == 1
    assert (_plan(V("two_pass", blocks_per_sm=1, passes=2)).slots,
            _plan(V("two_pass", blocks_per_sm=1, passes=2)).passes) == (16, 2)
    # The public attnres.plan reports the blocks per SM of its own (default) persistent plans: two at H = 7168,
    # one where the two-blocks geometry has no instance (H = 8192: 288 threads; FP8).
    p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=4096, candidates=9, hidden=7168, add=True,
                     device="h200")
    assert p.blocks_per_sm == 2 and p.slots == 8
    p = attnres.plan("attn_res_add_rmsnorm_persistent", tokens=4096, candidates=9, hidden=8192, add=True,
                     device="h200")
    assert p.blocks_per_sm == 1 and p.slots == 14
    declined = _plan(V("two_blocks", blocks_per_sm=2), H=8192)
    assert not declined.accepted and "needs <= 256 threads per block; H = 8192 takes 288" in declined.decline


@pytest.mark.parametrize("knob,value,limit", [("blocks_per_sm", 3, 2), ("blocks_per_sm", -1, 2), ("slots", 65, 64),
                                               ("slots", -1, 64), ("passes", 3, 2), ("passes", -2, 2)])
def test_values_out_of_range_raise_argument_error_and_change_nothing(knob, value, limit):
    v = V("bad", **{knob: value})
    want = (f"attn_res_add_rmsnorm_persistent: options.persistent_{knob} must be in [0, {limit}] (0: the plan's "
            f"choice), got {value}")
    with pytest.raises(attnres.ArgumentError) as exc:
        _plan(v)
    assert str(exc.value) == want
    inp = make_inputs(3, 4, 64, addends=1, seed=1)
    before = {k: b.clone() for k, b in inp.buffers.items()}
    with pytest.raises(attnres.ArgumentError) as exc:
        tuning.call(v, inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.norm_weight,
                    inp.rms_eps, inp.norm_eps, layer_residual_add=inp.add)
    # the call goes through attn_res_add_rmsnorm (the persistent entry point is its alias): its name leads
    assert str(exc.value) == want.replace("attn_res_add_rmsnorm_persistent: ", "attn_res_add_rmsnorm: ")
    assert_storage_unchanged(before, inp)


@pytest.mark.parametrize("value", [True, 1.0, "2", None])
def test_a_knob_that_is_not_an_int_is_refused(value):
    with pytest.raises(attnres.ArgumentError, match="variant 'x': slots must be an int"):
        V("x", slots=value)


@pytest.mark.parametrize("add", [True, False])
def test_the_cpu_call_is_the_public_op(add):
    """On CPU tensors the plan takes the CPU backend whatever the knobs: the same results as the public op."""
    inp = make_inputs(5, 3, 128, addends=1, seed=4)
    args = (inp.layer_residual, inp.block_residual, inp.res_weight, inp.rms_weight, inp.norm_weight, inp.rms_eps,
            inp.norm_eps)
    addend = inp.add if add else None
    want = attnres.attn_res_add_rmsnorm_persistent(*args, layer_residual_add=addend)
    got = tuning.call(V("two_blocks", blocks_per_sm=2, slots=2, passes=2), *args, layer_residual_add=addend)
    assert (got[0] is None) == (not add)
    if add:
        assert_same_bits(got[0], want[0], "updated")
    assert_same_bits(got[1], want[1], "output")
