"""The Kimi K3 chain's FP8 outputs (ResidualSettings.fp8, knob KIMI_K3_ATTN_RES_FP8): with them on, the bf16 chain
is bitwise the chain with them off; every pre-attention and pre-MLP site returns its output quantized, bitwise
attnres.fp8.quantize of that output, with scales in the ops' layout; the fused sites get it from their own op and
the rest (plain RMSNorm, eager) from the reference, as the path record says; the fold stays bitwise invisible."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import attnres.fp8 as fp8
import attnres.knobs as knobs
from attnres.models.kimi_k3 import (ChainTrace, KimiK3Config, KimiK3Model, ResidualSettings, bitwise_equal,
                                    compare_outputs, compare_traces)
from attnres.models.kimi_k3 import residual as R

POISON = -3.0
# 10 layers, block 4: layer 0 dense (its pre-attention a plain RMSNorm), snapshots at 0/4/8, MoE on 1..9, a tap.
CFG = KimiK3Config.small(hidden_size=256, num_layers=10, snapshot_block=4, capture_layers=(1, 5))
MODES = [("per_token", False), ("block128", False), ("per_token", True), ("block128", True)]
FUSED_PATHS = (R.FUSED, R.FUSED_ADD, R.FUSED_ADD2)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
_MODELS: dict = {}


def model_for(device: str, config: KimiK3Config = CFG) -> KimiK3Model:
    if (config, device) not in _MODELS:
        _MODELS[config, device] = KimiK3Model(config, settings=ResidualSettings(), device=device)
    return _MODELS[config, device]


def run(model: KimiK3Model, settings: ResidualSettings, T: int):
    model.settings = settings
    model.paths.clear()
    trace = ChainTrace()
    out = model(model.embed(T, step=T), bank=model.allocate_bank(T, fill=POISON), trace=trace)
    return out, trace, list(model.paths.entries)


def last_entry(record, site):
    return [e for e in record if e.site == site][-1]


def assert_sites_quantize_their_outputs(trace, record, settings):
    checked = 0
    for s in trace.sites:
        kind = s.site.rsplit(".", 1)[-1]
        entry = last_entry(record, s.site)
        if kind not in R.FP8_SITE_KINDS:
            assert s.fp8 is None and entry.fp8 == "", s.site
            continue
        codes, scales, source = s.fp8
        want_codes, want_scales = fp8.quantize(s.output, settings.fp8, settings.fp8_pow2)
        assert codes.dtype == torch.float8_e4m3fn and bitwise_equal(codes, want_codes), s.site
        assert bitwise_equal(scales, want_scales), s.site
        layout = fp8.empty_scales(settings.fp8, *s.output.shape, s.output.device)
        assert scales.shape == layout.shape and scales.stride() == layout.stride(), s.site
        assert entry.fp8 == source, s.site
        assert source == (R.FP8_FUSED if entry.path in FUSED_PATHS else R.FP8_REFERENCE), (s.site, entry.path)
        checked += 1
    assert checked == 2 * CFG.num_layers


@pytest.mark.parametrize("mode,pow2", MODES, ids=[f"{m}{'-pow2' if p else ''}" for m, p in MODES])
@pytest.mark.parametrize("fold", [False, True], ids=["fold_off", "fold_on"])
@pytest.mark.parametrize("T", [1, 5])
def test_fp8_on_keeps_the_bf16_chain_and_quantizes_every_gemm_site(device, T, fold, mode, pow2):
    model = model_for(device)
    on = ResidualSettings(fold=fold, fp8=mode, fp8_pow2=pow2)
    out_off, tr_off, rec_off = run(model, replace(on, fp8=None, fp8_pow2=False), T)
    out_on, tr_on, rec_on = run(model, on, T)
    diffs = compare_traces(tr_off, tr_on, fp8=False) + compare_outputs(out_off, out_on)
    assert not diffs, "fp8 on vs off:\n" + "\n".join(diffs[:20])
    assert [(e.site, e.path, e.kernel, e.reason) for e in rec_off] == [(e.site, e.path, e.kernel, e.reason)
                                                                        for e in rec_on]
    assert_sites_quantize_their_outputs(tr_on, rec_on, on)
    # Layer 0's pre-attention is a plain RMSNorm (no snapshot yet): the reference quantizes it; the rest is fused.
    assert {e.site for e in rec_on if e.fp8 == R.FP8_REFERENCE} == {"layer0.pre_attn"}
    if fold:
        assert {e.site for e in rec_on if e.path == R.FUSED_ADD2 and e.fp8 == R.FP8_FUSED} == {
            f"layer{i}.pre_attn" for i in range(2, CFG.num_layers)}


@pytest.mark.parametrize("mode,pow2", [("per_token", False), ("block128", True)], ids=["per_token", "block128-pow2"])
def test_fold_stays_bitwise_invisible_with_fp8_on(device, mode, pow2):
    model = model_for(device)
    fold = ResidualSettings(fold=True, fp8=mode, fp8_pow2=pow2)
    out_e, tr_e, _ = run(model, replace(fold, fold=False), 4)
    out_f, tr_f, rec = run(model, fold, 4)
    diffs = compare_traces(tr_e, tr_f) + compare_outputs(out_e, out_f)  # the FP8 codes and scales included
    assert not diffs, "fold vs eager with fp8:\n" + "\n".join(diffs[:20])
    assert rec and any(e.path == R.FUSED_ADD2 for e in rec)


@pytest.mark.parametrize("settings", [ResidualSettings(fused=False), ResidualSettings(topology="per_token", max_tokens=2),
                                      ResidualSettings(kernel="single_cta")],
                         ids=["fused_off", "window", "forced_kernel"])
def test_sites_without_the_fused_op_quantize_with_the_reference(device, settings):
    """Eager routes (fused sites off, T outside the window, a plan that declines the forced kernel on this device)
    have no FP8 epilogue: the reference quantizes their bf16 output, recorded as such."""
    if settings.kernel == "single_cta" and device == "cuda":
        pytest.skip("single_cta runs on the GPU: the plan does not decline it there")
    model = model_for(device)
    on = replace(settings, fp8="block128")
    out_off, tr_off, _ = run(model, settings, 4)
    out_on, tr_on, rec = run(model, on, 4)
    assert not compare_traces(tr_off, tr_on, fp8=False) + compare_outputs(out_off, out_on)
    assert_sites_quantize_their_outputs(tr_on, rec, on)
    gemm_sites = [last_entry(rec, s.site) for s in tr_on.sites if s.fp8 is not None]
    assert all(e.path in (R.EAGER, R.RMSNORM) and e.fp8 == R.FP8_REFERENCE for e in gemm_sites)


def test_the_pending_partial_route_quantizes_with_the_reference():
    """The TP all-reduce ops have no FP8 epilogue: a fused add site handed a PendingPartial returns the reference."""
    torch.manual_seed(3)
    T, H, k = 3, 256, 2
    bank = R.SnapshotBank.allocate(k + 1, T, H)
    bank.storage.copy_(torch.randn_like(bank.storage, dtype=torch.float32).to(torch.bfloat16))
    w = R.SiteWeights(*(torch.randn(H).to(torch.bfloat16) for _ in range(3)), 1e-5, 1e-5)
    prefix, add = (torch.randn(T, H).to(torch.bfloat16) for _ in range(2))
    settings = ResidualSettings(fp8="per_token", fused=False)
    reduced = []
    partial = R.PendingPartial(add, None, lambda: reduced.append(1) or add, lambda: None)
    rec = R.PathRecord()
    site = R.attn_res_add_site(prefix, partial, bank, k, w, settings, site="layer1.pre_mlp", fp8=True, record=rec)
    assert reduced == [1] and site.fp8.source == R.FP8_REFERENCE and rec.entries[-1].fp8 == R.FP8_REFERENCE
    want = fp8.quantize(site.output, "per_token")
    assert bitwise_equal(site.fp8.codes, want[0]) and bitwise_equal(site.fp8.scales, want[1])


# ------------------------------------------------------------------------------------------------ settings
@pytest.mark.parametrize("word,expected", [("none", (None, False)), ("per_token", ("per_token", False)),
                                           ("block128", ("block128", False)), ("per_token_pow2", ("per_token", True)),
                                           ("block128_pow2", ("block128", True))])
def test_the_knob_sets_mode_and_pow2(word, expected):
    s = ResidualSettings.from_knobs(knobs.load({"KIMI_K3_ATTN_RES_FP8": word}))
    assert (s.fp8, s.fp8_pow2) == expected


@pytest.mark.parametrize("kw,match", [(dict(fp8="block"), "fp8 must be None or one of"),
                                      (dict(fp8="none"), "fp8 must be None or one of"),
                                      (dict(fp8_pow2=True), "fp8_pow2 requires fp8")])
def test_settings_reject_bad_fp8(kw, match):
    with pytest.raises(ValueError, match=match):
        ResidualSettings(**kw)


def test_block128_needs_h_a_multiple_of_128_and_writes_nothing():
    cfg = KimiK3Config.small(hidden_size=136, num_layers=3, snapshot_block=4, capture_layers=())
    model = KimiK3Model(cfg, settings=ResidualSettings(fp8="block128"))
    bank = model.allocate_bank(2, fill=POISON)
    with pytest.raises(ValueError, match="block128 needs H a multiple of 128, got H = 136"):
        model(model.embed(2), bank=bank)
    assert bool((bank.storage == POISON).all())
    model.settings = ResidualSettings(fp8="per_token")  # per_token takes any H
    model(model.embed(2), bank=bank)
