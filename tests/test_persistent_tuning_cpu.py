"""The persistent kernel's tuning knobs without a GPU (attnres._persistent_tuning, python -m bench
persistent --variants): the geometry each variant plans on a described H200, the ArgumentError of a value out of
range through every entry point of the hook (plan and call, which changes nothing), the CPU call, the
benchmark's variant list, its readers of records and its command line."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres import _persistent_tuning as tuning
from bench import persistent_variants as pv
from bench.cli import main as bench_main
from helpers import assert_same_bits, assert_storage_unchanged, make_inputs

V = tuning.Variant


def _plan(v, T=16384, N=9, H=7168, add=True):
    return tuning.plan(v, tokens=T, candidates=N, hidden=H, add=add, device="h200")


def test_variant_geometry_on_a_described_h200():
    base = _plan(V("one_block", blocks_per_sm=1))
    assert (base.blocks_per_sm, base.slots, base.passes, base.blocks, base.threads) == (1, 16, 1, 132, 256)
    two = _plan(V("two_blocks", blocks_per_sm=2))
    automatic = _plan(V("default"))
    assert (automatic.blocks_per_sm, automatic.slots, automatic.passes, automatic.blocks) == (2, 7, 2, 264)
    assert (two.blocks_per_sm, two.slots, two.passes, two.blocks, two.threads) == (2, 7, 2, 264, 256)
    assert two.smem_bytes == 1280 + 7 * 14336 and two.vectors == base.vectors
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
    assert p.blocks_per_sm == 2 and p.slots == 7
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


def test_benchmark_variants_of_each_point():
    for N in (2, 9):
        got = pv.variants(4096, N, 7168, True, device="h200")
        assert [v.name for v, _ in got] == list(pv.NAMES)
        plans = {v.name: p for v, p in got}
        assert all(p.accepted for p in plans.values()), {k: p.decline for k, p in plans.items()}
        assert plans["spare1"].slots == N + 2 and plans["spare1"].passes == 1
        assert plans["half_ring"].slots == plans["two_blocks"].slots == 7
        assert plans["half_ring"].blocks_per_sm == 1 and plans["two_blocks"].blocks_per_sm == 2
        assert plans["two_pass"].passes == 2 and plans["one_block"].slots == 16
        assert all(plans[n].blocks_per_sm == 1 for n in ("one_block", "spare1", "two_pass", "half_ring"))
        assert (plans["default"].blocks_per_sm, plans["default"].slots) == (2, 7)  # the plan's: two blocks
        assert len({p.threads for p in plans.values()}) == 1  # the bits' geometry never moves
    assert pv.points() == [(4096, 2, True), (16384, 2, True), (4096, 9, True), (16384, 9, True)]


def _rec(provider, us, *, T=4096, N=9, equal=True, copy=4.27):
    nbytes = 100_000_000
    gbps = nbytes / (us * 1e-6) / 1e9
    variant = provider.split(":", 1)[1] if ":" in provider else None
    geometry = {"blocks": 132, "blocks_per_sm": 1, "threads": 256, "slots": 16, "passes": 1, "smem_bytes": 0}
    return {"suite": "persistent_variants", "provider": provider, "variant": variant, "T": T, "N": N, "H": 7168,
            "add": True, "bytes": nbytes, "gbps": gbps, "copy_tbs": copy, "pct_copy": 100 * gbps / (copy * 1000),
            "geometry": geometry if variant else None, "bitwise_equal": equal, "median_us": us, "p10_us": us,
            "p90_us": us}


def test_summary_and_bit_check_read_the_records():
    recs = [_rec("attnres/persistent:default", 40.0), _rec("attnres/persistent:two_blocks", 32.0),
            _rec(pv.PER_TOKEN, 45.0),
            {"suite": "persistent_variants", "provider": "attnres/persistent:spare1", "variant": "spare1", "T": 4096,
             "N": 9, "H": 7168, "add": True, "declined": "persistent_slots = 99: ..."},
            {"suite": "decode", "provider": "x"}]
    lines = pv.summary(recs)
    assert lines[0] == "persistent variants T=4096 N=9 H=7168 add (copy floor 4.27 TB/s)"
    two = next(line for line in lines if "two_blocks" in line)
    assert "1.25x default" in two and "73.2% of copy" in two and "BITS DIFFER" not in two
    assert any("spare1" in line and "declined: persistent_slots = 99" in line for line in lines)
    assert pv.differing(recs) == []
    recs.append(_rec("attnres/persistent:two_pass", 50.0, equal=False))
    assert pv.differing(recs) == [(4096, 9, 7168, "attnres/persistent:two_pass")]
    assert any("two_pass" in line and "BITS DIFFER" in line for line in pv.summary(recs))


def test_the_suite_runs_on_the_cpu_backend(monkeypatch):
    """The suite's own code end to end without a GPU: CPU inputs, graphs replaced by eager calls, the plans of a
    described H200, a fake timer. Every variant is called (bits checked against the per-token path) and recorded."""
    from attnres.bench import timing, workloads

    calls = []
    monkeypatch.setattr(pv, "make_sets", lambda *a, **k: workloads.make_sets(*a, **k, device="cpu"))
    monkeypatch.setattr(pv, "rotating_sets", lambda nbytes, minimum: 2)  # (the L2 size needs a GPU)
    monkeypatch.setattr(pv, "capture", lambda fns: calls.append(len(fns)) or [fn() for fn in fns])
    monkeypatch.setattr(pv, "time_interleaved", lambda graphs, repeats: {
        name: timing.Timing(median_us=10.0 + i, p10_us=9.0, p90_us=12.0, min_us=9.0, calls=n, repeats=repeats)
        for i, (name, (_, n)) in enumerate(graphs.items())})
    plan = tuning.plan
    monkeypatch.setattr(tuning, "plan", lambda v, **q: plan(v, **{**q, "device": "h200"}))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    recs = pv.run(H=64, copy_tbs=4.0, repeats=3, tokens=(5,), candidates=(2, 3))
    assert len(calls) == 2 * (len(pv.NAMES) + 1) and set(calls) == {pv.MIN_CALLS}
    assert {(r["N"], r["provider"]) for r in recs} == {(N, p) for N in (2, 3) for p in
                                                      [f"attnres/persistent:{n}" for n in pv.NAMES] + [pv.PER_TOKEN]}
    assert all(r["bitwise_equal"] and r["T"] == 5 and r["add"] for r in recs)
    two = next(r for r in recs if r["variant"] == "two_blocks" and r["N"] == 3)
    assert two["geometry"]["blocks_per_sm"] == 2 and two["geometry"]["blocks"] == 5
    assert pv.differing(recs) == [] and any("two_blocks" in line for line in pv.summary(recs))


def test_token_time_and_model_fit():
    """τ per block = time over ceil(T / blocks) rounds; the fit through N = 2 (R = 3) and N = 9 (R = 10)."""
    a = _rec("attnres/persistent:default", 3.5 * 32, N=2)
    b = _rec("attnres/persistent:default", 7.4 * 32, N=9)
    assert pv.token_time_us(a) == pytest.approx(3.5)  # 4096 tokens over 132 blocks: 32 rounds
    assert pv.token_time_us(_rec(pv.PER_TOKEN, 10.0)) is None
    fit = pv.model_fit([a, b, _rec(pv.PER_TOKEN, 1.0)])
    c_row, c_fix = fit[("default", 4096, 7168, True)]
    assert c_row == pytest.approx((7.4 - 3.5) / 7) and c_fix == pytest.approx(3.5 - 3 * c_row)
    assert any(line.startswith("model fit default T=4096 H=7168: 0.557 us per row") for line in pv.summary([a, b]))


def test_cli(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["tune", "--variants"])
    assert exc.value.code == 2 and "--variants applies to the persistent suite only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench_main(["persistent", "--variants", "--quick"])
    assert exc.value.code == 2 and "--variants has one grid" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench_main(["persistent", "--variants"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
