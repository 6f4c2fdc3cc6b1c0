"""The tensor-parallel checks, run on every rank of a group (`python -m tp_check check`, tests/tp/test_tp_chain.py):

1. ranks agree: after every decode step each rank holds bit-identical prefixes, normed outputs and taps at
   every site, the bank after every layer, and the model output;
2. TP = W against the TP = 1 chain on the summed partials (Shards.summed): for W = 2 the whole chain, bitwise
   (each element of a two-rank all-reduce is one commutative, once-rounded addition); for every W, each
   all-reduce within (W - 1) u sum|p_r| of the exact sum of the partials it joined (AuditedAllReduce) — the
   only sound comparison once the summation order is the library's (W > 2), since a top-k router turns a
   one-ulp difference into another expert;
3. fold on == fold off under TP, bitwise, with the fold actually taken;
3a. the one-shot ops (attnres.all_reduce*, docs/ops/all_reduce.md) in the chain: every rank the same bits; at
   W = 2 the chain with them == the torch.distributed chain bitwise, with the attention, MoE finalize and (fold
   on) shared sites fused; at W = 4, 8 those sites fused; at any other W every site declines (world size);
4. the chain's MoE consumes the local-route finalize + all-reduce + latent norm: recomputed independently
   from a layer's recorded input, through attnres.moe_finalize and torch.distributed directly;
5. the finalize under TP at Kimi K3's latent shape (D = 3584, k = 16 on CUDA): routes split between ranks
   (each local on exactly one rank, -1 elsewhere), ranks agree, TP = 2 equals the summed partials bitwise,
   and the TP = 1 finalize of the same routing (one fp32 accumulation, norm in the op) within a stated bound.

`mutation` switches on one deliberate fault (tests prove the checks catch each).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

import attnres
from attnres.models.kimi_k3 import ChainTrace, KimiK3Config, ResidualSettings, compare_outputs, compare_traces
from attnres.all_reduce import MOE_WORLD_SIZES, record_all_reduce_decisions
from attnres.models.kimi_k3.residual import FUSED_ADD2, PendingPartial
from attnres.models.kimi_k3.sublayers import _LayerRandom
from attnres.models.kimi_k3.tp import (FUSED, ROUTED_SCALE, FusedAllReduce, Shards, StandInRoutedExperts, TPMoE,
                                       finalize_split_bound, finalize_tp, latent_width, tensor_parallel_model,
                                       unit_roundoff)
from attnres.moe import rmsnorm_two_rounding
from attnres.reference import check_close

from .launch import RankContext

BANK_FILL = -3.0  # bank rows before a step writes them: bf16-exact and finite, so whole banks compare bitwise
FINALIZE_K = 16
FINALIZE_EXPERTS = 64
MUTATIONS = (
    "none",
    "skip_all_reduce",  # each rank keeps its own partial (no join): ranks differ, TP != TP = 1
    "norm_before_all_reduce",  # the latent RMSNorm per rank on its partial, then the all-reduce
    "fold_off_sums_partials",  # fold off joins routed + shared partials with one all-reduce (other rounding)
    "rank_dependent_output",  # rank 1 perturbs its model output after the step
)


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}" + (f"  ({self.detail})" if self.detail else "")


def cpu_config() -> KimiK3Config:
    """The CPU stand-in: Kimi K3's structure at test size (dense layer 0, MoE from 1, MLA layers, taps, a
    capture firing on a snapshot layer), quick enough for two gloo ranks on a 2-core machine."""
    return KimiK3Config.small(hidden_size=256, num_layers=14, snapshot_block=4, capture_layers=(1, 3, 9))


# ------------------------------------------------------------------------------------------ rank agreement
def _bytes(tensors: list[Tensor | None], device) -> Tensor:
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors if t is not None]
    return torch.cat(flat).to(device) if flat else torch.zeros(0, dtype=torch.uint8, device=device)


def ranks_disagree(ctx: RankContext, tensors: list[Tensor | None]) -> list[int]:
    """Ranks whose bits differ from rank 0's (every rank gets the same answer)."""
    mine = _bytes(tensors, ctx.device)
    sizes = ctx.all_gather_object(int(mine.numel()))
    if len(set(sizes)) != 1:
        return [r for r, n in enumerate(sizes) if n != sizes[0]]
    gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine)
    return [r for r in range(1, ctx.world_size) if not torch.equal(gathered[r], gathered[0])]


def trace_tensors(out, trace: ChainTrace) -> list[Tensor | None]:
    ts = [t for s in trace.sites for t in (s.prefix, s.output, s.tap)]
    ts += [b for _, b in trace.banks]
    return ts + [out.output, out.bank.storage] + [out.taps[c] for c in sorted(out.taps)]


# ------------------------------------------------------------------------------------------ mutations
class _NoJoin:
    """skip_all_reduce: the hook does nothing, each rank keeps its partial."""

    def __call__(self, t: Tensor) -> Tensor:
        return t


def _mutated_shards(ctx: RankContext, mutation: str) -> Shards:
    shards = ctx.shards()
    if mutation == "skip_all_reduce":
        return replace(shards, all_reduce=_NoJoin())
    return shards


class _NormBeforeAllReduce:
    """norm_before_all_reduce: replaces TPMoE.latent with the latent norm applied per rank to its partial."""

    def __init__(self, moe: TPMoE):
        self.moe = moe

    def __call__(self, y: Tensor) -> tuple[Tensor, Tensor]:
        from attnres.models.kimi_k3.tp import finalize_partial

        m = self.moe
        partials = [rmsnorm_two_rounding(finalize_partial(m.local_pieces(y, r)), m.norm_weight, m.eps)
                    for r in m.shards.ranks]
        normed = m.shards.reduce(partials)
        return normed, normed


class _FoldOffSumsPartials:
    """fold_off_sums_partials: the summed MoE output (fold off) joins routed + shared partials in one all-reduce
    — cheaper, but another rounding than the fold's two reduced parts."""

    def __init__(self, moe: TPMoE):
        self.moe = moe

    def __call__(self, y: Tensor, *, return_parts: bool = False):
        m = self.moe
        if return_parts:
            return m(y, return_parts=True)
        routed, partials = m.routed(y), m.shared_expert.partials(y)
        # The replicated routed part joins rank 0's partial only, so the reduced sum is still the total.
        mixed = [(routed + p) if rank == 0 else p for rank, p in zip(m.shards.ranks, partials, strict=True)]
        return m.shards.reduce(mixed)


def _apply_model_mutation(model, mutation: str) -> None:
    for layer in model.layers:
        if not layer.is_moe:
            continue
        if mutation == "norm_before_all_reduce":
            layer.mlp.latent = _NormBeforeAllReduce(layer.mlp)
        elif mutation == "fold_off_sums_partials":
            layer.mlp = _FoldOffSumsPartials(layer.mlp)


# ------------------------------------------------------------------------------------------ the chain
class _MoERecorder:
    """Wraps a TPMoE: returns what it returns; keeps the input and the parts of the calls that ask for parts."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[Tensor, Tensor, Tensor]] = []

    def __call__(self, y: Tensor, *, return_parts: bool = False):
        out = self.inner(y, return_parts=return_parts)
        if return_parts:
            self.calls.append((y, *out))
        return out


def _step(model, x: Tensor, bank, fold: bool):
    model.settings = ResidualSettings(fold=fold)
    model.paths.clear()
    trace = ChainTrace()
    out = model(x, bank=bank, trace=trace)
    return out, trace


class AuditedAllReduce:
    """Wraps a reduction hook: before each call gathers every rank's partial, after it checks the result
    against the exact (float64) sum: |result - sum_r p_r| <= 1.01 (W - 1) u sum_r |p_r|, u = 2^-8 — any order
    of W - 1 bf16 additions (or an fp32 accumulation rounded once) stays inside. This is how TP = W is held to
    "the TP = 1 chain on the summed partials" where the all-reduce order is not ours (W > 2): per reduction,
    on the inputs the chain actually had. The chain end to end is compared bitwise only at W = 2: a top-k
    router turns a one-ulp difference upstream into another expert downstream."""

    def __init__(self, inner, world_size: int):
        self.inner, self.world_size = inner, world_size
        self.calls, self.violations = 0, []

    def reset(self) -> None:
        self.calls, self.violations = 0, []

    def __call__(self, t: Tensor) -> Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        exact = sum(p.detach().double().cpu() for p in parts)
        magnitude = sum(p.detach().double().abs().cpu() for p in parts)
        out = self.inner(t)
        err = (out.detach().double().cpu() - exact).abs()
        bound = 1.01 * (self.world_size - 1) * unit_roundoff() * magnitude
        if not bool((err <= bound).all()):
            self.violations.append(f"call {self.calls} {list(t.shape)}: max |err| {float(err.max()):.3g}, "
                                   f"max |err| / bound {float((err / bound.clamp(min=1e-30)).max()):.2f}")
        self.calls += 1
        return out


def _consumes_local_finalize(ctx: RankContext, moe: TPMoE, calls: list, mutation: str) -> list[str]:
    """Recomputes a recorded MoE call independently: this rank's pieces -> attnres.moe_finalize (no norm) ->
    torch.distributed.all_reduce -> two-rounding latent RMSNorm -> up-projection must give the routed part the
    chain consumed, bit for bit; the shared partial -> all_reduce the shared part."""
    diffs = []
    for i, (y, routed, shared) in enumerate(calls):
        pieces = moe.local_pieces(y, ctx.rank)
        latent = attnres.moe_finalize(pieces.rows, pieces.weights, pieces.index, eps=0.0, scale=ROUTED_SCALE)
        dist.all_reduce(latent)
        normed = rmsnorm_two_rounding(latent, moe.norm_weight, moe.eps)
        if not torch.equal(moe.routed_from_latent(normed).view(torch.int16), routed.view(torch.int16)):
            diffs.append(f"call {i}: routed differs")
        s = moe.shared_expert.partial(y, ctx.rank)
        if isinstance(shared, PendingPartial):  # the fold site all-reduces it in its fused op
            shared = shared.partial
        else:
            dist.all_reduce(s)
        if not torch.equal(s.view(torch.int16), shared.view(torch.int16)):
            diffs.append(f"call {i}: shared differs")
    return diffs


def chain_checks(ctx: RankContext, config: KimiK3Config, tokens: int, *, steps: int = 2, seed: int = 0,
                 mutation: str = "none") -> list[Check]:
    W = ctx.world_size
    shards = _mutated_shards(ctx, mutation)
    audit = AuditedAllReduce(shards.all_reduce, W)
    tp = tensor_parallel_model(config, replace(shards, all_reduce=audit), device=ctx.device)
    ref = tensor_parallel_model(config, Shards.summed(W), device=ctx.device)
    _apply_model_mutation(tp, mutation)
    moe_layers = [layer for layer in tp.layers if layer.is_moe]
    watched = [moe_layers[0], moe_layers[-1]] if moe_layers else []
    for layer in watched:
        layer.mlp = _MoERecorder(layer.mlp)
    from attnres.comm import Communicator

    comms = [Communicator.create(tokens, config.hidden_size, device=ctx.device),
             Communicator.create(tokens, latent_width(config), device=ctx.device)]
    fused = tensor_parallel_model(config, replace(ctx.shards(), fused=FusedAllReduce(*comms, enabled=True)),
                                  device=ctx.device)
    banks = {(name, fold): m.allocate_bank(tokens, fill=BANK_FILL)
             for name, m in (("tp", tp), ("ref", ref), ("fused", fused)) for fold in (False, True)}
    checks = []
    tag = f"T={tokens}"
    for step in range(steps):
        x = tp.embed(tokens, step=seed + step)
        runs, audits = {}, {}
        for fold in (False, True):
            audit.reset()
            runs["tp", fold] = _step(tp, x, banks["tp", fold], fold)
            audits[fold] = (audit.calls, list(audit.violations))
            if fold:
                folded_sites = len(tp.paths.select(path=FUSED_ADD2))
            runs["ref", fold] = _step(ref, x, banks["ref", fold], fold)
            with record_all_reduce_decisions() as decisions:
                runs["fused", fold] = _step(fused, x, banks["fused", fold], fold)
            audits["fused", fold] = decisions
        if mutation == "rank_dependent_output" and ctx.rank == 1:
            runs["tp", True][0].output.view(torch.int16)[0, 0] ^= 1
        s = f"{tag} step {step}"
        for fold in (False, True):
            out, trace = runs["tp", fold]
            bad = ranks_disagree(ctx, trace_tensors(out, trace))
            checks.append(Check(f"{s} fold {'on' if fold else 'off'}: ranks bit-identical (every site's prefix, "
                                f"output and tap, the bank after every layer, the model output)", not bad,
                                f"ranks {bad} differ from rank 0" if bad else
                                f"{len(trace.sites)} sites, {len(trace.banks)} banks, {W} ranks"))
            calls, violations = audits[fold]
            checks.append(Check(f"{s} fold {'on' if fold else 'off'}: every all-reduce within (W-1) u sum|p_r| of "
                                f"the exact sum of the {W} ranks' partials", calls > 0 and not violations,
                                "; ".join(violations[:4]) if violations else f"{calls} all-reduces"))
            f_out, f_trace = runs["fused", fold]
            decisions = audits["fused", fold]
            taken = sorted({d.site for d in decisions if d.path == FUSED})
            bad = ranks_disagree(ctx, trace_tensors(f_out, f_trace))
            checks.append(Check(f"{s} fold {'on' if fold else 'off'}: one-shot ops: every rank holds the same bits", not bad,
                                f"ranks {bad} differ from rank 0" if bad else f"{len(decisions)} reductions"))
            if W in MOE_WORLD_SIZES:
                # At W = 2 the one-shot sum (fp32, rounded once) is NCCL's/gloo's bf16 add bit for bit.
                diffs = (compare_traces(trace, f_trace) + compare_outputs(out, f_out)) if W == 2 else []
                want = {"attention", "moe_finalize"} | ({"shared"} if fold else set())
                ok = not diffs and want <= set(taken)
                name = "== the torch.distributed path (bitwise)" if W == 2 else "taken"
            else:
                why = {d.reason for d in decisions}
                ok = not taken and all("world size" in r or "no one-shot" in r for r in why) and bool(decisions)
                diffs, name = [], "decline (world size)"
            checks.append(Check(f"{s} fold {'on' if fold else 'off'}: one-shot fused ops {name}", ok,
                                "; ".join(diffs[:4]) if diffs else f"fused at {taken}; " + ", ".join(
                                    sorted({f'{d.site}:{d.path}' + (f' ({d.reason})' if d.reason else '')
                                            for d in decisions}))))
            if W == 2:
                diffs = compare_traces(runs["ref", fold][1], trace) + compare_outputs(runs["ref", fold][0], out)
                checks.append(Check(f"{s} fold {'on' if fold else 'off'}: TP=2 == TP=1 on the summed partials "
                                    "(bitwise)", not diffs, "; ".join(diffs[:4]) if diffs else "bitwise"))
        diffs = compare_traces(runs["tp", False][1], runs["tp", True][1]) + compare_outputs(runs["tp", False][0],
                                                                                            runs["tp", True][0])
        ok = not diffs and folded_sites > 0
        checks.append(Check(f"{s}: fold on == fold off under TP={W} (bitwise)", ok,
                            "; ".join(diffs[:4]) if diffs else
                            (f"fold taken at {folded_sites} sites" if folded_sites else "the fold was never taken")))
    for layer in watched:
        rec = layer.mlp
        diffs = _consumes_local_finalize(ctx, rec.inner if isinstance(rec.inner, TPMoE) else rec.inner.moe,
                                         rec.calls, mutation)
        checks.append(Check(f"{tag} layer {layer.layer}: the chain's MoE parts are the local-route finalize + "
                            "all-reduce + latent norm (recomputed independently)", not diffs and bool(rec.calls),
                            "; ".join(diffs[:4]) if diffs else f"{len(rec.calls)} calls, bitwise"))
    for c in comms:
        c.close()
    return checks


# ------------------------------------------------------------------------------------------ the finalize
def finalize_shape(device: torch.device) -> tuple[int, int, int]:
    """(D, k, E) of the finalize check: Kimi K3's latent 3584 and top-16 on CUDA; D = 256 on the CPU."""
    return (3584 if device.type == "cuda" else 256), FINALIZE_K, FINALIZE_EXPERTS


def _exact_latent(pieces, scale: float) -> Tensor:
    """float64 sum_j w * row over the valid routes, times scale (no rounding)."""
    rows = pieces.rows.detach().double().cpu()
    w = pieces.weights.detach().double().cpu()
    idx = pieces.index.detach().long().cpu()
    valid = idx >= 0
    gathered = rows[idx.clamp(min=0)] * w.unsqueeze(-1)
    gathered[~valid] = 0
    return gathered.sum(1) * scale


def finalize_checks(ctx: RankContext, tokens: int, *, seed: int = 0, mutation: str = "none") -> list[Check]:
    W, dev = ctx.world_size, ctx.device
    D, k, E = finalize_shape(dev)
    cfg = KimiK3Config.small(hidden_size=max(D, 256), num_layers=2, snapshot_block=2, seed=seed)
    rnd = _LayerRandom(cfg, 1000 + tokens, role=99, device=dev)
    experts = StandInRoutedExperts(D, E, k, 128, rnd)
    norm_weight = rnd.vec(D, 1.0, 0.1).to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed * 31 + tokens)
    z = torch.randn(tokens, D, generator=g).to(torch.bfloat16).float().to(dev)
    weights, ids = experts.route(z)
    shards = _mutated_shards(ctx, mutation)
    eps = cfg.norm_eps
    local = experts.pieces(z, weights, ids, experts.owned(ctx.rank, W))
    latent, normed = finalize_tp([local], shards, norm_weight, eps)
    everyone = [experts.pieces(z, weights, ids, experts.owned(r, W)) for r in range(W)]
    ref_latent, ref_normed = finalize_tp(everyone, Shards.summed(W), norm_weight, eps)
    whole = experts.pieces(z, weights, ids, range(E))
    tp1_latent = attnres.moe_finalize(whole.rows, whole.weights, whole.index, eps=eps, scale=ROUTED_SCALE)
    tp1 = attnres.moe_finalize(whole.rows, whole.weights, whole.index, norm_weight=norm_weight, eps=eps,
                               scale=ROUTED_SCALE)
    tag = f"finalize T={tokens} D={D} k={k} E={E}"
    checks = []

    owners = (local.index >= 0).to(torch.int32)
    dist.all_reduce(owners)
    remote = int((local.index < 0).sum())
    split_ok = bool((owners == 1).all()) and (W == 1 or remote > 0)
    checks.append(Check(f"{tag}: every route is local on exactly one rank (-1 on the others)", split_ok,
                        f"{remote} of {tokens * k} routes remote on rank {ctx.rank}"))
    bad = ranks_disagree(ctx, [latent, normed])
    checks.append(Check(f"{tag}: ranks bit-identical after the all-reduce and the latent norm", not bad,
                        f"ranks {bad} differ" if bad else f"{W} ranks"))
    same = torch.equal(latent.view(torch.int16), ref_latent.view(torch.int16)) and torch.equal(
        normed.view(torch.int16), ref_normed.view(torch.int16))
    if W == 2:
        checks.append(Check(f"{tag}: TP=2 == the summed local-route partials (bitwise)", same,
                            "bitwise" if same else "differs"))

    # Against the TP = 1 finalize of the same routing: a bound on the latent before the norm, the contract's
    # tolerance after it.
    partials = [attnres.moe_finalize(p.rows, p.weights, p.index, eps=0.0, scale=ROUTED_SCALE) for p in everyone]
    exact = _exact_latent(whole, ROUTED_SCALE)
    err = (latent.double().cpu() - tp1_latent.double().cpu()).abs()
    bound = finalize_split_bound(partials, exact)
    within = bool((err <= bound).all())
    differing = int((latent.view(torch.int16) != tp1_latent.view(torch.int16)).sum())
    checks.append(Check(f"{tag}: TP={W} latent (before the norm) vs the TP=1 finalize: |diff| <= u(sum|P_r| + "
                        f"{W}|S|), u = 2^-8", within,
                        f"{differing} of {latent.numel()} elements differ in bits, max |diff| {float(err.max()):.3g}, "
                        f"max |diff| / bound {float((err / bound.clamp(min=1e-30)).max()):.3f}"))
    try:
        check_close(normed, tp1, f"{tag} normed")
        close, why = True, ""
    except AssertionError as e:
        close, why = False, str(e)
    differing = int((normed.view(torch.int16) != tp1.view(torch.int16)).sum())
    checks.append(Check(f"{tag}: TP={W} normed latent vs the TP=1 finalize with the norm in the op (contract "
                        "tolerance)", close, why or f"{differing} of {normed.numel()} elements differ in bits, max "
                                                   f"|diff| {float((normed.float() - tp1.float()).abs().max()):.3g}"))
    return checks


# ------------------------------------------------------------------------------------------ all of it
def run_checks(ctx: RankContext, *, tokens=(1, 8), config: KimiK3Config | None = None, steps: int = 2,
               seed: int = 0, finalize: bool = True, mutation: str = "none") -> list[Check]:
    if mutation not in MUTATIONS:
        raise ValueError(f"mutation must be one of {MUTATIONS}, got {mutation!r}")
    config = config or (KimiK3Config.real() if ctx.device.type == "cuda" else cpu_config())
    checks = []
    for T in tokens:
        checks += chain_checks(ctx, config, T, steps=steps, seed=seed, mutation=mutation)
        if finalize:
            checks += finalize_checks(ctx, T, seed=seed, mutation=mutation)
    return checks


def merge(per_rank: list[list[Check]]) -> list[Check]:
    """One check per name: passed on every rank; the detail of the first rank that failed (else rank 0's)."""
    merged = []
    for i, c0 in enumerate(per_rank[0]):
        failed = [(r, checks[i]) for r, checks in enumerate(per_rank) if not checks[i].passed]
        if failed:
            r, c = failed[0]
            merged.append(Check(c0.name, False, f"rank {r}: {c.detail}"))
        else:
            merged.append(c0)
    return merged
