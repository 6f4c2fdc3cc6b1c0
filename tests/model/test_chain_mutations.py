"""The chain comparison has teeth: each mutation of the fold's hand-off (the rounding of the two additions, a
dropped tail, a tail consumed at the wrong site, a lost snapshot write, a tap from the wrong stream) makes the
fold-vs-eager comparison of test_chain FAIL, and names what differs. Every mutation touches only the folded
path, counts that it ran, and is undone by monkeypatch after the test."""

from __future__ import annotations

import pytest
import torch

import attnres
from attnres.models.kimi_k3 import (ChainTrace, KimiK3Config, KimiK3Model, PendingTail, ResidualSettings,
                                    compare_outputs, compare_traces)
from attnres.models.kimi_k3 import decoder as D

CFG = KimiK3Config.small(hidden_size=256, num_layers=26, snapshot_block=4)
_MODELS: dict = {}


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _model(device: str) -> KimiK3Model:
    if device not in _MODELS:
        _MODELS[device] = KimiK3Model(CFG, settings=ResidualSettings(), device=device)
    return _MODELS[device]


def fold_vs_eager(device: str, T: int = 4, aux_stream: bool = True) -> list[str]:
    model = _model(device)
    x = model.embed(T, step=21)
    results = []
    for fold in (False, True):
        model.settings = ResidualSettings(fold=fold, aux_stream=aux_stream)
        trace = ChainTrace()
        out = model(x, bank=model.allocate_bank(T, fill=-3.0), trace=trace)
        results.append((out, trace))
    (out_e, tr_e), (out_f, tr_f) = results
    return compare_traces(tr_e, tr_f) + compare_outputs(out_e, out_f)


def _slot_row(block: torch.Tensor, slot: int) -> torch.Tensor:
    """Bank row `slot` addressed through the candidate view's strides (as the op's snapshot_slot does)."""
    return block.as_strided(block.shape[1:], block.stride()[1:], block.storage_offset() + slot * block.stride(0))


def _wrap_add2(monkeypatch, mutate):
    """Replaces attnres.attn_res_add_rmsnorm for calls with layer_residual_add2 (the fold only); returns the
    list its calls are counted in."""
    real = attnres.attn_res_add_rmsnorm
    calls = []

    def wrapper(prefix, add, block, *weights, layer_residual_add2=None, return_mixture=False, snapshot_slot=None,
                options=None):
        if layer_residual_add2 is None:
            return real(prefix, add, block, *weights, return_mixture=return_mixture, snapshot_slot=snapshot_slot,
                        options=options)
        calls.append(1)
        return mutate(real, prefix, add, layer_residual_add2, block, weights, return_mixture, snapshot_slot, options)

    monkeypatch.setattr(attnres, "attn_res_add_rmsnorm", wrapper)
    return calls


def _site_from_prefix(P, block, weights, return_mixture, snapshot_slot, options, tap_from=None):
    """The fold's outputs computed from a given materialized prefix (the snapshot row written by copy)."""
    output, mixture = attnres.attn_res_rmsnorm(P, block, *weights, return_mixture=True, options=options)
    if tap_from is not None:
        mixture = attnres.attn_res_rmsnorm(tap_from, block, *weights, return_mixture=True, options=options)[1]
    if snapshot_slot is not None:
        _slot_row(block, snapshot_slot).copy_(P)
    return (P, output, mixture) if return_mixture else (P, output)


def one_rounding(real, prefix, routed, shared, block, weights, return_mixture, snapshot_slot, options):
    P = (prefix.float() + routed.float() + shared.float()).to(torch.bfloat16)
    return _site_from_prefix(P, block, weights, return_mixture, snapshot_slot, options)


def reassociated(real, prefix, routed, shared, block, weights, return_mixture, snapshot_slot, options):
    P = (prefix + routed) + shared  # two bf16 roundings, the wrong pairing
    return _site_from_prefix(P, block, weights, return_mixture, snapshot_slot, options)


def shared_dropped(real, prefix, routed, shared, block, weights, return_mixture, snapshot_slot, options):
    return real(prefix, routed, block, *weights, return_mixture=return_mixture, snapshot_slot=snapshot_slot,
                options=options)


def snapshot_lost(real, prefix, routed, shared, block, weights, return_mixture, snapshot_slot, options):
    return real(prefix, routed, block, *weights, layer_residual_add2=shared, return_mixture=return_mixture,
                options=options)


def tap_from_stale_prefix(real, prefix, routed, shared, block, weights, return_mixture, snapshot_slot, options):
    P = prefix + (routed + shared)
    return _site_from_prefix(P, block, weights, return_mixture, snapshot_slot, options, tap_from=prefix)


ADD2_MUTATIONS = {
    "one_rounding_fp32": (one_rounding, ["prefix differs", "output differs", "model output differs"]),
    "reassociated": (reassociated, ["prefix differs", "output differs"]),
    "shared_dropped": (shared_dropped, ["prefix differs", "bank after layer"]),
    "snapshot_write_lost": (snapshot_lost, ["bank after layer", "final bank differs"]),
    "tap_from_stale_prefix": (tap_from_stale_prefix, ["tap differs", "tap of layer"]),
}


def test_unmutated_chain_passes(device):
    assert fold_vs_eager(device) == []


@pytest.mark.parametrize("name", list(ADD2_MUTATIONS))
def test_add2_hand_off_mutation_fails_the_comparison(device, name, monkeypatch):
    mutate, expected = ADD2_MUTATIONS[name]
    calls = _wrap_add2(monkeypatch, mutate)
    diffs = fold_vs_eager(device)
    assert calls, "the mutation never ran: the fold was not taken"
    assert diffs, f"mutation {name} went unnoticed"
    for what in expected:
        assert any(what in d for d in diffs), (what, diffs[:10])


def _wrap_site(monkeypatch, mutate):
    real = D.attn_res_site
    calls = []

    def wrapper(carried, bank, k, w, settings, **kw):
        if isinstance(carried, PendingTail):
            calls.append(kw.get("site"))
            return mutate(real, carried, bank, k, w, settings, **kw)
        return real(carried, bank, k, w, settings, **kw)

    monkeypatch.setattr(D, "attn_res_site", wrapper)
    return calls


def tail_dropped(real, tail, bank, k, w, settings, **kw):
    return real(tail.prefix, bank, k, w, settings, **kw)


def consumed_one_site_late(real, tail, bank, k, w, settings, **kw):
    """The pre-attention site mixes the stale prefix; the tail lands only afterwards (as if a later site took it)."""
    if kw.get("site") == "output":
        return real(tail, bank, k, w, settings, **kw)
    stale = real(tail.prefix, bank, k, w, settings, **kw)
    return stale._replace(prefix=tail.materialize())


def consumed_twice(real, tail, bank, k, w, settings, **kw):
    """The tail is added at its consumer and once more (a pending tail not cleared after consumption)."""
    return real(PendingTail(tail.materialize(), tail.routed, tail.shared), bank, k, w, settings, **kw)


SITE_MUTATIONS = {
    "tail_dropped": (tail_dropped, ["prefix differs", "model output differs"]),
    "consumed_one_site_late": (consumed_one_site_late, ["pre_attn: output differs"]),
    "consumed_twice": (consumed_twice, ["prefix differs"]),
}


@pytest.mark.parametrize("name", list(SITE_MUTATIONS))
def test_site_hand_off_mutation_fails_the_comparison(device, name, monkeypatch):
    mutate, expected = SITE_MUTATIONS[name]
    calls = _wrap_site(monkeypatch, mutate)
    diffs = fold_vs_eager(device)
    assert len(calls) == CFG.num_layers - 1, calls  # every MoE tail went through the mutation
    assert diffs, f"mutation {name} went unnoticed"
    for what in expected:
        assert any(what in d for d in diffs), (what, diffs[:10])


def test_raw_prefix_taps_are_compared_too(device, monkeypatch):
    """With taps holding the raw prefix, a fold whose `updated` is off shows up in the taps as well."""
    _wrap_add2(monkeypatch, reassociated)
    diffs = fold_vs_eager(device, aux_stream=False)
    assert any("tap of layer" in d for d in diffs), diffs[:10]


def test_materialize_order_mutation_fails_on_materialized_sites(device, monkeypatch):
    """Where the tail is materialized first (here: every consumer, via a tiny N limit), the materializing adds
    must be the eager chain's: (routed + shared) first."""
    model = _model(device)
    x = model.embed(4, step=22)
    monkeypatch.setattr(PendingTail, "materialize", lambda t: (t.prefix + t.routed) + t.shared)
    outs = []
    for fold in (False, True):
        model.settings = ResidualSettings(fold=fold, fold_max_candidates=1)
        model.paths.clear()
        outs.append(model(x, bank=model.allocate_bank(4, fill=-3.0)))
    assert len(model.paths.select(path="materialize", reason="max_candidates")) == CFG.num_layers - 1
    assert compare_outputs(*outs), "a materialize with the wrong pairing went unnoticed"
