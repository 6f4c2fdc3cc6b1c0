"""The fold's dispatch, one site at a time: inside the window the consumer takes the fused add2 path (the record
says so, with the plan's kernel), outside it the eager path; with the persistent topology the plan declines
add2, the helper declines, and the caller adds first — with results bitwise equal to the eager sequence
`prefix + (routed + shared)` then the unchanged site. Also each other materialize-first rule, the decision
log, and the helpers' argument checks."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

import attnres
from attnres import reference
from attnres.models.kimi_k3 import (PathRecord, PendingTail, ResidualSettings, SiteWeights, SnapshotBank,
                                    attn_res_add_site, attn_res_site, eager_attn_res_rmsnorm, fold_route, rmsnorm,
                                    tail_route, try_fold)
from attnres.models.kimi_k3 import residual as R

H = 256
KMAX = 8
EPS = (1e-5, 1e-6)  # unequal rms / norm eps: a swap would show


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows(T: int, g, scale: float = 1.0, device="cpu") -> torch.Tensor:
    return (scale * torch.randn(T, H, generator=g)).to(torch.bfloat16).to(device)


def make_case(T: int, k: int, device: str, seed: int, layout: str = "snapshot_major"):
    g = _gen(seed)
    bank = SnapshotBank.allocate(KMAX, T, H, layout=layout, device=device, fill=-3.0)
    for s in range(k):
        bank.row(s).copy_(rows(T, g, scale=(0.5, 1.0, 4.0)[s % 3], device=device))
    w = SiteWeights(rows(1, g, 0.02, device)[0], (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16).to(device),
                    (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16).to(device), *EPS)
    tail = PendingTail(rows(T, g, 2.0, device), rows(T, g, 1.0, device), rows(T, g, 0.7, device))
    return bank, w, tail


def eager_sequence(tail: PendingTail, bank: SnapshotBank, k: int, w: SiteWeights, mixture: bool = False):
    """What the fold-off chain does at a fused consumer: two bf16 adds, then the no-add op."""
    P = tail.prefix + (tail.routed + tail.shared)
    out, mix = attnres.attn_res_rmsnorm(P, bank.candidates(k), *w.args(), return_mixture=True)
    return P, out, (mix if mixture else None)


FOLD = ResidualSettings(fold=True)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ------------------------------------------------------------------------------------------------ the window
@pytest.mark.parametrize("layout", ["snapshot_major", "token_major"])
@pytest.mark.parametrize("T,k", [(1, 1), (1, 8), (8, 4), (32, 2), (32, 7)])
def test_inside_the_window_the_fused_add2_path_runs(device, T, k, layout):
    bank, w, tail = make_case(T, k, device, seed=T * 31 + k, layout=layout)
    record = PathRecord()
    got = attn_res_site(tail, bank, k, w, FOLD, site="s", record=record)
    plan = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=k + 1, hidden=H, device=device, add=True,
                        add2=True, options=FOLD.options)
    assert [(e.path, e.tokens, e.candidates, e.kernel) for e in record.entries] == [
        (R.FUSED_ADD2, T, k + 1, plan.kernel)]
    P, out, _ = eager_sequence(tail, bank, k, w)
    assert torch.equal(got.prefix, P) and torch.equal(got.output, out)
    assert got.route.path == R.FUSED_ADD2


@pytest.mark.parametrize("mixture", [False, True])
def test_fold_with_snapshot_write_and_tap(device, mixture):
    T, k = 4, 3
    bank, w, tail = make_case(T, k, device, seed=7)
    untouched = [bank.row(s).clone() for s in range(KMAX)]
    got = attn_res_site(tail, bank, k, w, FOLD, mixture=mixture, snapshot=True)
    P, out, mix = eager_sequence(tail, bank, k, w, mixture)
    assert got.route.path == R.FUSED_ADD2
    assert torch.equal(got.prefix, P) and torch.equal(got.output, out)
    assert (got.mixture is None) is (not mixture) and (not mixture or torch.equal(got.mixture, mix))
    assert torch.equal(bank.row(k), P)  # written through the op's snapshot_slot
    for s in range(KMAX):
        if s != k:
            assert torch.equal(bank.row(s), untouched[s]), s


def test_outside_the_window_the_eager_path_runs(device):
    settings = ResidualSettings(fold=True, max_tokens=4, topology="per_token")
    assert tail_route(settings, tokens=4, hidden=H, dtype=torch.bfloat16).path == R.DEFER
    producer = tail_route(settings, tokens=5, hidden=H, dtype=torch.bfloat16)
    assert (producer.path, producer.reason) == (R.MATERIALIZE, R.WINDOW)
    # A tail that reaches a consumer outside the window anyway is materialized, and the site runs eager.
    T, k = 8, 3
    bank, w, tail = make_case(T, k, device, seed=8)
    record = PathRecord()
    got = attn_res_site(tail, bank, k, w, settings, site="s", record=record)
    assert [(e.path, e.reason) for e in record.entries] == [(R.MATERIALIZE, R.WINDOW), (R.EAGER, R.WINDOW)]
    P = tail.prefix + (tail.routed + tail.shared)
    out, _ = eager_attn_res_rmsnorm(P, bank.candidates(k), w, settings.eager_options)
    assert torch.equal(got.prefix, P) and torch.equal(got.output, out)


def test_window_zero_never_folds(device):
    settings = ResidualSettings(fold=True, max_tokens=0)
    assert tail_route(settings, tokens=1, hidden=H, dtype=torch.bfloat16).reason == R.WINDOW


# ------------------------------------------------------------------------------------------------ persistent
@pytest.mark.parametrize("topology,T", [("persistent", 1), ("persistent", 16), ("split", 40)])
def test_persistent_topology_folds_the_tail(device, topology, T):
    """The persistent kernel streams the second addend as one more row: the fold runs on it (where the unfused
    site does), with the bits of the materialized tail then the site."""
    settings = ResidualSettings(fold=True, topology=topology, max_tokens=32)
    k = 5
    bank, w, tail = make_case(T, k, device, seed=9 + T)
    plan = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=k + 1, hidden=H, device=device, add=True,
                        add2=True, options=settings.options)
    base = attnres.plan("attn_res_rmsnorm", tokens=T, candidates=k + 1, hidden=H, device=device,
                        options=settings.options)
    assert plan.accepted == base.accepted and plan.kernel == base.kernel, (plan, base)
    record = PathRecord()
    got = attn_res_site(tail, bank, k, w, settings, site="s", record=record)
    assert record.entries[0].path == (R.FUSED_ADD2 if base.accepted else R.MATERIALIZE), record.entries
    P = tail.prefix + (tail.routed + tail.shared)
    assert torch.equal(got.prefix, P)
    unchanged = attn_res_site(P, bank, k, w, settings)  # the fold-off chain's site
    assert torch.equal(got.output, unchanged.output)


def test_persistent_topology_still_runs_one_addend_sites(device):
    """The persistent kernel takes one addend: pre-MLP sites stay on the fused op where the plan accepts it."""
    settings = ResidualSettings(topology="persistent")
    T, k = 4, 2
    bank, w, tail = make_case(T, k, device, seed=10)
    plan = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=k + 1, hidden=H, device=device, add=True,
                        options=settings.options)
    got = attn_res_add_site(tail.prefix, tail.routed, bank, k, w, settings)
    assert got.route.path == (R.FUSED_ADD if plan.accepted else R.EAGER)
    P = tail.prefix + tail.routed
    assert torch.equal(got.prefix, P)
    reference.check_close(got.output, reference.attn_res(P, bank.candidates(k), w.res_weight, w.rms_weight, EPS[0],
                                                         norm_weight=w.norm_weight, norm_eps=EPS[1]).output)


# ------------------------------------------------------------------------------------------------ other rules
def test_no_snapshots_materializes_and_runs_a_plain_rmsnorm(device):
    bank, w, tail = make_case(4, 0, device, seed=11)
    record = PathRecord()
    got = attn_res_site(tail, bank, 0, w, FOLD, site="s", mixture=True, record=record)
    assert [(e.path, e.reason, e.candidates) for e in record.entries] == [
        (R.MATERIALIZE, R.NO_SNAPSHOTS, 1), (R.RMSNORM, R.NO_SNAPSHOTS, 1)]
    P = tail.prefix + (tail.routed + tail.shared)
    assert torch.equal(got.prefix, P) and torch.equal(got.mixture, P)  # N = 1: the mixture is the prefix
    assert torch.equal(got.output, rmsnorm(P, w.norm_weight, EPS[1]))


def test_tap_capability_flag(device):
    bank, w, tail = make_case(4, 3, device, seed=12)
    no_tap = ResidualSettings(fold=True, kernel_emits_tap=False)
    route, result = try_fold(tail, bank, 3, w, no_tap, mixture=True)
    assert result is None and route.reason == R.TAP
    got = attn_res_site(tail, bank, 3, w, no_tap, mixture=True)
    P = tail.prefix + (tail.routed + tail.shared)
    out, mix = eager_attn_res_rmsnorm(P, bank.candidates(3), w, no_tap.eager_options)
    assert got.route.path == R.EAGER and torch.equal(got.output, out) and torch.equal(got.mixture, mix)
    # Untapped sites keep the fold; with the capability (attnres kernels), tapped ones do too.
    assert try_fold(tail, bank, 3, w, no_tap, mixture=False)[0].path == R.FUSED_ADD2
    assert try_fold(tail, bank, 3, w, FOLD, mixture=True)[0].path == R.FUSED_ADD2


def test_candidate_limit(device):
    bank, w, tail = make_case(4, 5, device, seed=13)
    limited = ResidualSettings(fold=True, fold_max_candidates=6)
    assert try_fold(tail, bank, 5, w, limited)[0].path == R.FUSED_ADD2  # N = 6
    assert try_fold(tail, bank, 6, w, limited)[0].reason == R.MAX_CANDIDATES_REASON  # N = 7


def test_final_capture(device):
    bank, w, tail = make_case(4, 8, device, seed=14)
    route, result = try_fold(tail, bank, 8, w, FOLD, mixture=True, final_capture=True)
    assert result is None and route.reason == R.FINAL_CAPTURE
    got = attn_res_site(tail, bank, 8, w, FOLD, mixture=True, final_capture=True)
    P, out, mix = eager_sequence(tail, bank, 8, w, mixture=True)
    assert got.route.path == R.FUSED and torch.equal(got.output, out) and torch.equal(got.mixture, mix)


def test_device_without_the_requested_kernel(device):
    absent = "single_cta" if device == "cpu" else "cpu"
    settings = ResidualSettings(fold=True, kernel=absent)
    bank, w, tail = make_case(4, 2, device, seed=15)
    assert not attnres.plan("attn_res_add_rmsnorm", tokens=4, candidates=3, hidden=H, device=device, add=True,
                            add2=True, options=settings.options).accepted
    route, result = try_fold(tail, bank, 2, w, settings)
    assert result is None and route.reason == R.DEVICE and route.detail
    got = attn_res_site(tail, bank, 2, w, settings)
    P = tail.prefix + (tail.routed + tail.shared)
    out, _ = eager_attn_res_rmsnorm(P, bank.candidates(2), w, settings.eager_options)
    assert got.route.path == R.EAGER and torch.equal(got.output, out)


def test_fold_needs_the_same_kernel_as_the_unfused_site(device, monkeypatch):
    """Bitwise equality of add2 and the materialized prefix is a property of one kernel: if the plan ever chose
    another kernel for the add2 call than for the unfused site, the consumer materializes first."""
    real = R._plan

    def other_kernel_for_add2(op, tokens, candidates, hidden, dev, add, add2, *rest):
        p = real(op, tokens, candidates, hidden, dev, add, add2, *rest)
        return replace(p, kernel="split_k" if p.kernel == "single_cta" else "single_cta") if add2 else p

    monkeypatch.setattr(R, "_plan", other_kernel_for_add2)
    bank, w, tail = make_case(4, 3, device, seed=20)
    route, result = try_fold(tail, bank, 3, w, FOLD)
    assert result is None and route.reason == R.KERNEL
    got = attn_res_site(tail, bank, 3, w, FOLD)
    P, out, _ = eager_sequence(tail, bank, 3, w)
    assert got.route.path == R.FUSED and torch.equal(got.prefix, P) and torch.equal(got.output, out)


@pytest.mark.parametrize("settings,reason", [(ResidualSettings(), None),
                                             (ResidualSettings(fold=True, fused=False), R.FUSED_OFF)])
def test_producer_routes(settings, reason):
    route = tail_route(settings, tokens=1, hidden=H, dtype=torch.bfloat16)
    assert route.path == (R.SUM if reason is None else R.MATERIALIZE) and route.reason == (reason or "")
    assert tail_route(FOLD, tokens=1, hidden=H, dtype=torch.float16).reason == R.DTYPE
    assert tail_route(FOLD, tokens=1, hidden=H + 4, dtype=torch.bfloat16).reason == R.HIDDEN


def test_fold_route_is_pure_and_follows_the_plan():
    for T in (1, 8, 32):
        for N in range(2, 17):
            route = fold_route(FOLD, tokens=T, candidates=N, hidden=7168, device="cpu", tap=False, snapshot=True)
            plan = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=N, hidden=7168, device="cpu",
                                add=True, add2=True, snapshot=True, options=FOLD.options)
            assert (route.path == R.FUSED_ADD2) is plan.accepted and route.kernel == (plan.kernel or "")


# ------------------------------------------------------------------------------------------------ bitwise edges
def test_subnormal_tails_fold_bitwise(device):
    """routed + shared and the prefix sum in the subnormal range: the fold keeps PyTorch's bits (no flush)."""
    T, k = 4, 2
    bank, w, _ = make_case(T, k, device, seed=16)
    g = _gen(17)
    tiny = 2.0 ** -130
    routed = (tiny * torch.randn(T, H, generator=g)).to(torch.bfloat16).to(device)
    shared = (-routed.float() + tiny * torch.randn(T, H, generator=g).to(device)).to(torch.bfloat16)
    prefix = (tiny * torch.randn(T, H, generator=g)).to(torch.bfloat16).to(device)
    prefix[:, : H // 2] = rows(T, g, 1.0, device)[:, : H // 2]  # half the row normal, half subnormal
    tail = PendingTail(prefix, routed, shared)
    got = attn_res_site(tail, bank, k, w, FOLD)
    P, out, _ = eager_sequence(tail, bank, k, w)
    assert got.route.path == R.FUSED_ADD2
    assert torch.equal(got.prefix.view(torch.int16), P.view(torch.int16))
    assert torch.equal(got.output.view(torch.int16), out.view(torch.int16))
    sub = P.float().abs()
    assert ((sub > 0) & (sub < 2.0 ** -126)).any()  # the case really has subnormal sums


def test_model_rmsnorm_is_the_two_rounding_norm(device):
    g = _gen(18)
    x, wt = rows(8, g, 3.0, device), (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16).to(device)
    got = rmsnorm(x, wt, 1e-5)
    reference.check_close(got, reference.two_rounding_rmsnorm(x, wt, 1e-5))
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(got, (normed.float() * wt.float()).to(torch.bfloat16))
    one_rounding = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * wt.float()).to(torch.bfloat16)
    assert not torch.equal(got, one_rounding)  # the two orders differ on these inputs: the test can tell


# ------------------------------------------------------------------------------------------------ the record
def test_one_debug_line_per_distinct_site_path_tokens_candidates(device, caplog):
    record = PathRecord()
    with caplog.at_level(logging.DEBUG, logger="attnres.models.kimi_k3"):
        for T in (4, 4, 2, 4):
            bank, w, tail = make_case(T, 3, device, seed=19)
            attn_res_site(tail, bank, 3, w, FOLD, site="layer4.pre_attn", record=record)
        bank, w, tail = make_case(4, 3, device, seed=19)
        attn_res_site(tail, bank, 3, w, ResidualSettings(fold=True, fold_max_candidates=2), site="layer4.pre_attn",
                      record=record)
    lines = [r.getMessage() for r in caplog.records if r.name == "attnres.models.kimi_k3"]
    assert len(record.entries) == 6
    assert len(lines) == 4, lines  # fused_add2 at T=4, at T=2, materialize at T=4, fused at T=4
    assert sum("fused_add2" in line and "T=4, N=4" in line for line in lines) == 1
    assert any("materialize" in line and "max_candidates" in line for line in lines)


def test_record_select_and_summary():
    record = PathRecord()
    record.add("layer3.pre_attn", R.Route(R.FUSED_ADD2, "cpu"), 4, 2)
    record.add("layer3.moe_tail", R.Route(R.DEFER), 4, 2)
    record.add("output", R.Route(R.MATERIALIZE, reason=R.FINAL_CAPTURE), 4, 9)
    assert [e.site for e in record.select(kind="moe_tail")] == ["layer3.moe_tail"]
    assert [e.site for e in record.select(reason=R.FINAL_CAPTURE)] == ["output"]
    assert record.summary()[("pre_attn", R.FUSED_ADD2, "cpu", "")] == 1
    quiet = PathRecord(keep=False)
    quiet.add("x", R.Route(R.FUSED), 1, 2)
    assert quiet.entries == []


# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("bad", [dict(topology="fast"), dict(max_tokens=-1), dict(fold_max_candidates=0),
                                 dict(fold_max_candidates=17), dict(kernel="tensor_core")])
def test_settings_reject(bad):
    with pytest.raises(ValueError):
        ResidualSettings(**bad)


def test_settings_from_knobs_maps_every_field():
    from attnres.knobs import Knobs
    k = Knobs(moe_tail_add_fold=True, fused_attn_res=False, fused_attn_res_max_tokens=9, attn_res_topology="split",
              aux_attn_res_stream=False, attn_res_fp8="block128_pow2", moe_finalize_max_tokens=2,
              moe_finalize_allreduce_max_tokens=2, fused_all_reduce=True)
    s = ResidualSettings.from_knobs(k)
    assert (s.fold, s.fused, s.max_tokens, s.topology, s.aux_stream) == (True, False, 9, "split", False)
    assert (s.fp8, s.fp8_pow2) == ("block128", True)
    assert s.options == attnres.Options(topology="split", split_max_tokens=9)
    assert ResidualSettings.from_knobs(k, fold=False).fold is False


def test_snapshot_bank_views_and_rejections(device):
    T = 3
    tm = SnapshotBank.allocate(5, T, H, layout="token_major", device=device, fill=1.0)
    assert tm.storage.shape == (T, 5, H) and tm.rows == 5 and tm.tokens == T
    view = tm.candidates(2)
    assert view.shape == (2, T, H) and view.stride() == (H, 5 * H, 1)
    assert view.data_ptr() == tm.storage.data_ptr()
    tm.row(4).fill_(2.0)
    assert torch.equal(tm.storage[:, 4], torch.full((T, H), 2.0, dtype=torch.bfloat16, device=device))
    for storage, layout in [(torch.zeros(2, T, H, device=device), "snapshot_major"),
                            (torch.zeros(T, H, dtype=torch.bfloat16, device=device), "snapshot_major"),
                            (torch.zeros(2, T, 2 * H, dtype=torch.bfloat16, device=device)[..., ::2], "snapshot_major"),
                            (torch.zeros(2, T, H, dtype=torch.bfloat16, device=device), "rows")]:
        with pytest.raises(ValueError):
            SnapshotBank(storage, layout)
