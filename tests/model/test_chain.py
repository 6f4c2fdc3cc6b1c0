"""The Kimi K3 decode chain with deferred MoE tails (the fold) is bitwise equal to the eager chain: every site's
prefix, normed output and tap, the snapshot bank after every layer, and the model output — with the fold taken
everywhere it can be, and with each materialize-first case of docs/model.md forced at least once (asserted
through the path record). Plus the chain's own structure against model.md's per-layer sequence."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import attnres
from attnres.models.kimi_k3 import (ChainTrace, KimiK3Config, KimiK3Model, PendingTail, ResidualSettings,
                                    SnapshotBank, compare_outputs, compare_traces, rmsnorm)
from attnres.models.kimi_k3 import residual as R
from conftest import requires_cuda

POISON = -3.0  # unwritten bank rows hold this (bf16-exact, finite, so rows compare bitwise)

# 26 layers, block 4: 7 snapshots (N up to 8), MoE on 1..25, taps firing on a snapshot layer (4) and mid-block.
SMALL = KimiK3Config.small(hidden_size=256, num_layers=26, snapshot_block=4)
# Kimi's own block of 12 at test size: 37 layers, 4 snapshots.
BLOCK12 = KimiK3Config.small(hidden_size=256, num_layers=37, snapshot_block=12, capture_layers=(1, 11, 19))

_MODELS: dict = {}


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def model_for(config: KimiK3Config, device: str) -> KimiK3Model:
    key = (config, device)
    if key not in _MODELS:
        _MODELS[key] = KimiK3Model(config, settings=ResidualSettings(), device=device)
    return _MODELS[key]


def run_chain(model: KimiK3Model, settings: ResidualSettings, hidden):
    model.settings = settings
    model.paths.clear()
    T = (hidden.prefix if isinstance(hidden, PendingTail) else hidden).shape[0]
    trace = ChainTrace()
    out = model(hidden, bank=model.allocate_bank(T, fill=POISON), trace=trace)
    return out, trace, list(model.paths.entries)


def assert_fold_invisible(model: KimiK3Model, fold: ResidualSettings, hidden, eager_hidden=None):
    """Runs the chain eager (fold off) and folded; asserts every traced tensor is bitwise equal and returns the
    folded run's (output, trace, record)."""
    assert fold.fold
    out_e, tr_e, _ = run_chain(model, replace(fold, fold=False), hidden if eager_hidden is None else eager_hidden)
    out_f, tr_f, rec = run_chain(model, fold, hidden)
    cfg = model.config
    assert len(tr_f.sites) == 2 * cfg.num_layers + 1 and len(tr_f.banks) == cfg.num_layers
    diffs = compare_traces(tr_e, tr_f) + compare_outputs(out_e, out_f)
    assert not diffs, "fold vs eager:\n" + "\n".join(diffs[:20])
    assert sorted(out_f.taps) == sorted(cfg.capture_layers)
    return out_f, tr_f, rec


def sites(rec, **kw):
    return {e.site for e in rec if all(getattr(e, k) == v for k, v in kw.items())}


def moe_consumers(cfg: KimiK3Config) -> set[str]:
    names = {f"layer{layer + 1}.pre_attn" for layer in range(cfg.num_layers - 1) if cfg.is_moe_layer(layer)}
    return names | ({"output"} if cfg.is_moe_layer(cfg.num_layers - 1) else set())


# ------------------------------------------------------------------------------------------------ the fold
@pytest.mark.parametrize("layout", ["snapshot_major", "token_major"])
@pytest.mark.parametrize("T", [1, 4, 32])
def test_fold_is_bitwise_invisible(device, T, layout):
    cfg = SMALL.with_(bank_layout=layout)
    model = model_for(cfg, device)
    out, trace, rec = assert_fold_invisible(model, ResidualSettings(fold=True), model.embed(T, step=T))
    # The fold was taken at every consumer of a MoE tail — tapped sites and snapshot writes included.
    assert sites(rec, path=R.DEFER, kind="moe_tail") == {f"layer{i}.moe_tail" for i in range(1, cfg.num_layers)}
    assert sites(rec, path=R.FUSED_ADD2) == moe_consumers(cfg)
    assert not sites(rec, path=R.MATERIALIZE)
    tap_sites = {f"layer{c + 1}.pre_attn" for c in cfg.capture_layers if c >= 1}
    assert tap_sites <= sites(rec, path=R.FUSED_ADD2)
    assert any(cfg.is_snapshot_layer(c + 1) for c in cfg.capture_layers)  # a tapped snapshot site is covered
    # The rows the fold wrote through snapshot_slot hold the prefix of their snapshot site.
    prefix_at = {s.site: s.prefix for s in trace.sites}
    for s in range(cfg.num_snapshots):
        assert torch.equal(out.bank.row(s), prefix_at[f"layer{s * cfg.snapshot_block}.pre_attn"])


def test_fold_is_bitwise_invisible_with_raw_prefix_taps(device):
    model = model_for(SMALL, device)
    out, trace, rec = assert_fold_invisible(model, ResidualSettings(fold=True, aux_stream=False), model.embed(4, 1))
    prefix_at = {s.site: s.prefix for s in trace.sites}
    for c, tap in out.taps.items():
        assert torch.equal(tap, prefix_at[f"layer{c + 1}.pre_attn"])
    assert sites(rec, path=R.FUSED_ADD2) == moe_consumers(SMALL)


@pytest.mark.parametrize("T", [1, 8])
def test_fold_is_bitwise_invisible_with_kimi_block(device, T):
    model = model_for(BLOCK12, device)
    _, _, rec = assert_fold_invisible(model, ResidualSettings(fold=True), model.embed(T, 2))
    assert sites(rec, path=R.FUSED_ADD2) == moe_consumers(BLOCK12)


def test_fold_is_bitwise_invisible_over_several_steps_with_a_reused_bank(device):
    """The bank is rebuilt every step: reusing one buffer across steps changes nothing."""
    model = model_for(SMALL, device)
    bank_e, bank_f = model.allocate_bank(4, fill=POISON), model.allocate_bank(4, fill=POISON)
    for step in range(3):
        x = model.embed(4, step=10 + step)
        model.settings = ResidualSettings()
        out_e = model(x, bank=bank_e)
        model.settings = ResidualSettings(fold=True)
        out_f = model(x, bank=bank_f)
        assert not compare_outputs(out_e, out_f)


# ------------------------------------------------------------------------------------------------ materialize-first
FINAL_CAPTURED = SMALL.with_(capture_layers=SMALL.capture_layers + (SMALL.num_layers - 1,))


def _absent_kernel(device: str) -> str:
    return "single_cta" if device == "cpu" else "cpu"  # a kernel the plan declines on this device


CASES = {
    # case: (config, settings, T, the reason the record must show at least once)
    "tap": (SMALL, dict(kernel_emits_tap=False), 4, R.TAP),
    "no_snapshots": (SMALL, {}, 4, R.NO_SNAPSHOTS),
    "persistent_topology": (SMALL, dict(topology="persistent"), 4, R.TOPOLOGY),
    "max_candidates": (SMALL, dict(fold_max_candidates=3), 4, R.MAX_CANDIDATES_REASON),
    "final_capture": (FINAL_CAPTURED, {}, 4, R.FINAL_CAPTURE),
    # the per-token topology's window: above it the sites run eager (auto runs the fused kernels at any T)
    "window": (SMALL, dict(max_tokens=2, topology="per_token"), 4, R.WINDOW),
    "device": (SMALL, "absent_kernel", 4, R.DEVICE),
    "fused_off": (SMALL, dict(fused=False), 4, R.FUSED_OFF),
}


@pytest.mark.parametrize("case", list(CASES))
def test_materialize_first_keeps_the_chain_bitwise(device, case):
    cfg, overrides, T, reason = CASES[case]
    if overrides == "absent_kernel":
        overrides = dict(kernel=_absent_kernel(device))
    model = model_for(cfg, device)
    fold = ResidualSettings(fold=True, **overrides)
    hidden = eager_hidden = model.embed(T, step=3)
    if case == "no_snapshots":
        # Kimi K3's own schedule never hands layer 0 a tail (it is dense and snapshots first); a caller can.
        g = torch.Generator().manual_seed(5)
        parts = [torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16).to(device) for _ in range(2)]
        hidden = PendingTail(hidden, *parts)
        eager_hidden = hidden.materialize()
    out, _, rec = assert_fold_invisible(model, fold, hidden, eager_hidden)
    materialized = [e for e in rec if e.path == R.MATERIALIZE]
    assert any(e.reason == reason for e in materialized), sorted({(e.site, e.reason) for e in materialized})
    folded = sites(rec, path=R.FUSED_ADD2)
    if case == "tap":
        tap_sites = {f"layer{c + 1}.pre_attn" for c in cfg.capture_layers}
        assert sites(rec, path=R.MATERIALIZE, reason=R.TAP) == tap_sites  # every tapped site follows a MoE layer
        assert sites(rec, path=R.EAGER, reason=R.TAP) == tap_sites
        assert folded == moe_consumers(cfg) - tap_sites  # untapped sites keep the fold
    elif case == "no_snapshots":
        assert sites(rec, path=R.MATERIALIZE) == {"layer0.pre_attn"}
        assert folded == moe_consumers(cfg)
    elif case == "persistent_topology":
        # The persistent kernel takes both addends but not the tap: the tapped sites materialize (the plan's
        # decline of the tap), every other MoE consumer folds.
        tap_sites = {f"layer{c + 1}.pre_attn" for c in cfg.capture_layers}
        assert sites(rec, path=R.MATERIALIZE, reason=R.TOPOLOGY) == tap_sites & moe_consumers(cfg)
        assert folded == moe_consumers(cfg) - tap_sites
    elif case == "max_candidates":
        big = {e.site for e in rec if e.path == R.MATERIALIZE and e.candidates > 3}
        assert big and big == sites(rec, path=R.MATERIALIZE, reason=R.MAX_CANDIDATES_REASON)
        assert folded and all(e.candidates <= 3 for e in rec if e.path == R.FUSED_ADD2)
    elif case == "final_capture":
        assert sites(rec, path=R.MATERIALIZE) == {"output"}
        assert folded == moe_consumers(cfg) - {"output"}
        assert cfg.num_layers - 1 in out.taps
    elif case == "window":
        assert sites(rec, path=R.MATERIALIZE, reason=R.WINDOW, kind="moe_tail") == {
            f"layer{i}.moe_tail" for i in range(1, cfg.num_layers)}
        assert not folded and {e.path for e in rec if e.kind in ("pre_mlp", "output")} == {R.EAGER}
    elif case in ("device", "fused_off"):
        assert not folded and {e.path for e in rec if e.kind == "pre_mlp"} == {R.EAGER}


def test_window_edge_folds_at_the_ceiling_and_not_above(device):
    model = model_for(SMALL, device)
    for T, folds in ((2, True), (3, False)):
        _, _, rec = assert_fold_invisible(model, ResidualSettings(fold=True, max_tokens=2), model.embed(T, 4))
        assert bool(sites(rec, path=R.FUSED_ADD2)) is folds, T


# ------------------------------------------------------------------------------------------------ structure
def test_chain_follows_the_model_md_sequence(device):
    """An independent transcription of model.md's per-layer sequence (the public ops, no helpers) gives the
    model's bits, with the fold on and off."""
    cfg = SMALL
    model = model_for(cfg, device)
    T = 4
    x = model.embed(T, step=6)
    bank = torch.full((cfg.num_snapshots, T, cfg.hidden_size), POISON, dtype=torch.bfloat16, device=device)
    P, S, taps = x, 0, {}
    for L, layer in enumerate(model.layers):
        w = layer.attn_site
        if S == 0:
            h, mix = rmsnorm(P, w.norm_weight, w.norm_eps), P
        else:
            h, mix = attnres.attn_res_rmsnorm(P, bank[:S], *w.args(), return_mixture=True)
        if L - 1 in cfg.capture_layers:
            taps[L - 1] = mix
        if L % cfg.snapshot_block == 0:
            bank[S] = P
            S += 1
        a = layer.attention(h)
        w = layer.mlp_site
        if L % cfg.snapshot_block == 0:
            P = a
            y = attnres.attn_res_rmsnorm(P, bank[:S], *w.args())
        else:
            P, y = attnres.attn_res_add_rmsnorm(P, a, bank[:S], *w.args())
        P = P + layer.mlp(y)
    out, mix = attnres.attn_res_rmsnorm(P, bank[:S], *model.output_site.args(), return_mixture=True)
    assert S == cfg.num_snapshots == 7
    for fold in (False, True):
        got, _, _ = run_chain(model, ResidualSettings(fold=fold), x)
        assert torch.equal(got.output, out) and torch.equal(got.bank.storage, bank)
        assert sorted(got.taps) == sorted(taps) and all(torch.equal(got.taps[c], taps[c]) for c in taps)


def test_candidate_counts_and_bank_rows_follow_the_schedule(device):
    cfg = SMALL
    model = model_for(cfg, device)
    _, trace, rec = run_chain(model, ResidualSettings(fold=True), model.embed(4, 7))
    by_site = {e.site: e.candidates for e in rec if e.kind != "moe_tail"}
    for L in range(cfg.num_layers):
        assert by_site[f"layer{L}.pre_attn"] == cfg.pre_attention_candidates(L)
        assert by_site[f"layer{L}.pre_mlp"] == cfg.pre_mlp_candidates(L)
    assert by_site["output"] == cfg.output_candidates == cfg.num_snapshots + 1
    poison = torch.full((4, cfg.hidden_size), POISON, dtype=torch.bfloat16, device=device)
    for layer, storage in trace.banks:
        written = layer // cfg.snapshot_block + 1
        bank = SnapshotBank(storage, cfg.bank_layout)
        for s in range(cfg.num_snapshots):
            assert torch.equal(bank.row(s), poison) is (s >= written), (layer, s)


def test_real_config_schedule():
    cfg = KimiK3Config.real()
    assert (cfg.hidden_size, cfg.num_layers, cfg.snapshot_block) == (7168, 93, 12)
    assert cfg.rms_eps == cfg.norm_eps == 1e-5
    assert cfg.num_snapshots == 8 and cfg.output_candidates == 9
    assert [L for L in range(93) if cfg.is_snapshot_layer(L)] == [0, 12, 24, 36, 48, 60, 72, 84]
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(L) for L in range(1, 93))
    assert cfg.full_attention_layers == tuple(range(3, 92, 4)) + (92,) and len(cfg.full_attention_layers) == 24
    assert cfg.capture_layers == (1, 19, 37, 54, 72, 90)
    assert [cfg.tap_layer_at(L) for L in (2, 20, 38, 55, 73, 91)] == [1, 19, 37, 54, 72, 90]
    assert all(cfg.pre_attention_candidates(L) == (L - 1) // 12 + 2 for L in range(1, 93))
    assert all(cfg.pre_mlp_candidates(L) == L // 12 + 2 for L in range(93))
    assert max(cfg.pre_attention_candidates(L) for L in range(93)) == 9
    assert sum(1 for L in range(93)) * 2 + 1 == 187  # attention-residual sites per forward


@pytest.mark.parametrize("bad", [dict(hidden_size=260), dict(hidden_size=16392), dict(num_layers=0),
                                 dict(snapshot_block=0), dict(num_layers=93, snapshot_block=6),
                                 dict(capture_layers=(93,)), dict(bank_layout="rows"), dict(standin_rank=0),
                                 dict(rms_eps=-1.0)])
def test_config_rejects(bad):
    with pytest.raises(ValueError):
        KimiK3Config(**bad)


def test_model_rejects_bad_inputs_without_writing(device):
    model = model_for(SMALL, device)
    bank = model.allocate_bank(4, fill=POISON)
    before = bank.storage.clone()
    x = model.embed(4, 8)
    for bad_x, bad_bank in [(x.float(), bank), (x[:, :128], bank), (x[0], bank), (model.embed(3, 8), bank),
                            (x, SnapshotBank(bank.storage[:3], SMALL.bank_layout))]:
        with pytest.raises(ValueError):
            model(bad_x, bank=bad_bank)
        assert torch.equal(bank.storage, before)


def test_moe_runtime_parts_sum_to_its_output(device):
    model = model_for(SMALL, device)
    y = model.embed(8, 9)
    moe = model.layers[5].mlp
    routed, shared = moe(y, return_parts=True)
    assert routed.dtype == shared.dtype == torch.bfloat16 and routed.shape == shared.shape == y.shape
    assert torch.equal(moe(y), routed + shared)
    # Both parts carry weight, so the rounding of routed + shared matters (the fold must keep it).
    assert 0.2 < float(routed.float().std() / shared.float().std()) < 5
    assert not torch.equal(routed.float() + shared.float(), (routed + shared).float())


def test_stand_ins_are_deterministic_across_instances():
    a = KimiK3Model(SMALL, settings=ResidualSettings())
    b = KimiK3Model(SMALL, settings=ResidualSettings())
    x = a.embed(4)
    assert torch.equal(a(x).output, b(x).output)
    c = KimiK3Model(SMALL.with_(seed=1), settings=ResidualSettings())
    assert not torch.equal(a(x).output, c(x).output)


# ------------------------------------------------------------------------------------------------ the real schedule
@pytest.mark.slow
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("T", [1, 4, 32])
def test_real_schedule_fold_is_bitwise_invisible_cuda(T):
    cfg = KimiK3Config.real()
    model = model_for(cfg, "cuda")
    out, _, rec = assert_fold_invisible(model, ResidualSettings(fold=True), model.embed(T, step=T))
    assert sites(rec, path=R.FUSED_ADD2) == moe_consumers(cfg)  # 92 folds: layers 2..92 and the output
    assert len(sites(rec, path=R.FUSED_ADD2)) == 92 and not sites(rec, path=R.MATERIALIZE)
    assert {e.kernel for e in rec if e.path == R.FUSED_ADD2} <= {"single_cta", "split_k"}
    assert max(e.candidates for e in rec if e.kind == "pre_attn") == 9
    assert torch.isfinite(out.output.float()).all()
