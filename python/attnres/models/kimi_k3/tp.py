"""Tensor parallelism for the Kimi K3 decode chain: stand-in sub-layers whose output on each rank is a partial
sum, joined by an all-reduce before it reaches the residual stream (docs/tp.md).

The decoder, the sites and the fold are the ones of decoder.py / residual.py, unchanged: a tensor-parallel
model is a KimiK3Model whose attention and MLP are the stand-ins below. Each stand-in computes, per rank, the
partial its shard of a row-parallel projection produces, then calls the reduction hook. `Shards` says which
ranks' partials this process computes and how it joins them:

* under TP (`Shards.of_rank(rank, W, all_reduce)`): this rank's partial, then the all-reduce (NCCL / gloo
  through torch.distributed) — every rank then holds the same sum;
* the TP = 1 reference (`Shards.summed(W)`): every rank's partial computed in this process and summed in rank
  order by bf16 adds, no communication — "the TP = 1 chain on the summed partials";
* plain TP = 1 (`Shards()`, world 1): the whole projection, no reduction.

What is reduced, per layer:

* attention (KDA/MLA) and the dense MLP of layer 0: a [T, H] partial (the row-parallel output projection);
* the MoE: the routed experts are split between the ranks (expert parallelism). Each rank runs the deferred
  finalize on its local routes — `attnres.moe_finalize` with index -1 for remote experts, no norm — giving a
  [T, D] partial of the latent (D = 3584 for Kimi K3); the latent is all-reduced, then the latent RMSNorm
  and the (replicated) up-projection give the routed output, the same on every rank. The shared expert is
  row-parallel: a [T, H] partial, all-reduced. `moe(y, return_parts=True)` returns the two reduced parts,
  so the MoE-tail fold consumes them exactly as at TP = 1.

Bitwise facts (the repository's TP checks, python -m tp_check, assert them):

* after an all-reduce every rank holds the same bits (NCCL and gloo hand every rank the same result);
* with two ranks each element of an all-reduce is one addition p0 + p1, commutative and rounded once to bf16
  — PyTorch's bf16 `p0 + p1` bit for bit — so TP = 2 equals `Shards.summed(2)` bitwise. With more ranks the
  all-reduce's summation order is the library's, not ours: each all-reduce is within (W - 1) u sum|p_r| of
  the exact sum (u = 2^-8), and the chain as a whole may differ (a top-k router amplifies one ulp);
* fold on == fold off under TP: both chains consume the same reduced routed and shared tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

import attnres
from attnres import knobs as _knobs
from attnres.all_reduce import (MOE_WORLD_SIZES, AllReduceDecision, note_decision,
                                supports_moe_finalize_all_reduce)

from .config import KimiK3Config
from .decoder import KimiK3Model
from .residual import BF16, PendingPartial, ResidualSettings, rmsnorm
from .sublayers import _POOL_SQUARE, _POOL_WIDE, WeightPool, _LayerRandom, _slice

# Seed roles of the tensor-parallel stand-ins (distinct from the TP = 1 stand-ins' 1, 2, 3).
_ROLE_ATTN, _ROLE_DENSE, _ROLE_MOE = 21, 22, 23

ROUTED_SCALE = 2.827  # Kimi K3's routed_scaling_factor: the finalize applies it once, in fp32, to the sum
FINALIZE_ALIGN = 8  # rows per expert segment are padded to this (as a MoE runner leaves them); padding is NaN


def latent_width(config: KimiK3Config) -> int:
    """D of the stand-in MoE's latent: Kimi K3's 3584, or half of H for smaller test configs (a multiple of 8,
    as moe_finalize needs)."""
    return max(8, min(config.moe_latent, config.hidden_size // 2) // 8 * 8)


def shard_range(size: int, world_size: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of `size` items (the first size % W ranks take one more)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"shard_range: rank {rank} outside [0, {world_size})")
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def _sum_in_rank_order(partials: list[Tensor]) -> Tensor:
    total = partials[0]
    for p in partials[1:]:
        total = total + p
    return total


# Paths of an AllReduceDecision (attnres.all_reduce): the reduction fused into its consumer's op, the standalone
# one-shot all-reduce (the consumer has no fused form, or its route is not the fused op), torch.distributed.
FUSED, ONE_SHOT, FALLBACK = "fused", "one_shot", "fallback"


@dataclass(frozen=True)
class FusedAllReduce:
    """The one-shot all-reduce of a TP rank (docs/ops/all_reduce.md): `hidden` joins the [T, H] partials
    (attention, dense MLP, shared expert), `latent` the MoE's [T, D] finalize partial (a communicator has one
    width); either may be None. `enabled` is ATTNRES_FUSED_ALL_REDUCE; `moe_max_tokens` overrides
    ATTNRES_MOE_FINALIZE_ALLREDUCE_MAX_TOKENS (None: the knob)."""

    hidden: object = None
    latent: object = None
    enabled: bool = field(default_factory=lambda: _knobs.CURRENT.fused_all_reduce)
    moe_max_tokens: int | None = None

    def communicator(self, t: Tensor, world_size: int, latent: bool = False) -> tuple[object, str]:
        """(the communicator that takes an all-reduce of t [T, width] bf16, "") or (None, why not)."""
        if not self.enabled:
            return None, "ATTNRES_FUSED_ALL_REDUCE=0"
        comm = self.latent if latent else self.hidden
        if comm is None:
            return None, f"no communicator of the {'latent' if latent else 'hidden'} width"
        if comm.closed:
            return None, "the communicator is closed"
        if world_size not in MOE_WORLD_SIZES:
            return None, f"world size {world_size} has no one-shot kernel (2, 4 or 8)"
        if comm.world_size != world_size:
            return None, f"the communicator spans {comm.world_size} ranks, the group {world_size}"
        if t.dim() != 2 or t.dtype != BF16:
            return None, f"the partial is {tuple(t.shape)} {t.dtype}, not [T, D] bfloat16"
        T, D = t.shape
        if D != comm.width:
            return None, f"D = {D} is not the communicator's width {comm.width}"
        if T > comm.capacity:
            return None, f"T = {T} is above the communicator's capacity {comm.capacity}"
        if t.device.type != comm.device.type or (t.device.type == "cuda" and t.device != comm.device):
            return None, f"the partial is on {t.device}, the communicator on {comm.device}"
        if t.device.type == "cuda" and not attnres._C.cuda_backend_built():
            return None, "attnres was built without the CUDA backend"
        return comm, ""


@dataclass(frozen=True)
class Shards:
    """Which ranks' partials this process computes (`ranks`), in a group of `world_size`, and how it joins its
    sum with the other processes' (`all_reduce`: sums a tensor over the group in place or not and returns the
    result; None = identity, nothing to join)."""

    world_size: int = 1
    ranks: tuple[int, ...] = (0,)
    all_reduce: Callable[[Tensor], Tensor] | None = field(default=None, compare=False)
    fused: FusedAllReduce | None = field(default=None, compare=False)  # the one-shot ops, where they apply

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"Shards: world_size must be >= 1, got {self.world_size}")
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or any(
                not 0 <= r < self.world_size for r in self.ranks):
            raise ValueError(f"Shards: ranks must be distinct ranks in [0, {self.world_size}), got {self.ranks}")
        if self.all_reduce is None and len(self.ranks) != self.world_size:
            raise ValueError("Shards: without an all_reduce this process must compute every rank's partial")

    @classmethod
    def of_rank(cls, rank: int, world_size: int, all_reduce: Callable[[Tensor], Tensor],
                fused: FusedAllReduce | None = None) -> "Shards":
        """One rank of a tensor-parallel group; `fused`: its one-shot communicators (None: torch.distributed)."""
        return cls(world_size, (rank,), all_reduce, fused)

    @classmethod
    def summed(cls, world_size: int) -> "Shards":
        """The TP = 1 reference: every rank's partial here, summed in rank order (bf16 adds)."""
        return cls(world_size, tuple(range(world_size)))

    def _note(self, site: str, path: str, reason: str, t: Tensor) -> None:
        note_decision(AllReduceDecision(site, path, reason, int(t.shape[0]) if t.dim() else 0, self.world_size,
                                        str(t.device)))

    def _comm(self, t: Tensor, latent: bool = False) -> tuple[object, str]:
        if self.fused is None:
            return None, "no communicator"
        return self.fused.communicator(t, self.world_size, latent)

    def reduce(self, partials: list[Tensor], site: str = "reduce") -> Tensor:
        """The sum over the group of the partials of `ranks` (one per rank, in rank order). Under TP: the
        standalone one-shot all-reduce where `fused` supports it, else the torch.distributed hook (recorded)."""
        total = _sum_in_rank_order(partials)
        if self.all_reduce is None:
            return total
        comm, why = self._comm(total)
        self._note(site, ONE_SHOT if comm is not None else FALLBACK, why, total)
        return attnres.all_reduce(comm, total) if comm is not None else self.all_reduce(total)

    def defer(self, partials: list[Tensor], site: str) -> Tensor | PendingPartial:
        """This rank's partial left for its consumer to all-reduce in a fused op (a PendingPartial) when `fused`
        supports it; otherwise the reduced sum, as reduce()."""
        total = _sum_in_rank_order(partials)
        if self.all_reduce is None:
            return total
        comm, _ = self._comm(total)
        if comm is None:
            return self.reduce([total], site)
        return PendingPartial(total, comm, lambda: self.reduce([total], site),
                              lambda: self._note(site, FUSED, "", total))


def torch_distributed_all_reduce(group=None) -> Callable[[Tensor], Tensor]:
    """The reduction hook of a torch.distributed group (NCCL on CUDA, gloo on the CPU): an in-place sum.
    Capturable in a CUDA graph on NCCL once the communicator is warm."""
    import torch.distributed as dist

    def all_reduce(t: Tensor) -> Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return all_reduce


# ------------------------------------------------------------------------------------------ row-parallel stand-ins
class _RowParallel:
    """The shape every tensor-parallel stand-in shares: features h computed column-parallel (rank r's columns K_r
    of a replicated input), then the row-parallel projection: partial_r = bf16((h[:, K_r] @ W[K_r]) * gain)."""

    site = "reduce"  # the AllReduceDecision site of this stand-in's reduction

    def __init__(self, shards: Shards, width: int):
        if width < shards.world_size:
            raise ValueError(f"tensor parallelism over {shards.world_size} ranks needs a stand-in width >= that, "
                             f"got {width}")
        self.shards = shards
        self.columns = {r: shard_range(width, shards.world_size, r) for r in shards.ranks}

    def partial(self, x: Tensor, rank: int) -> Tensor:
        raise NotImplementedError

    def partials(self, x: Tensor) -> list[Tensor]:
        """The partials this process computes (one per rank of shards.ranks)."""
        return [self.partial(x, r) for r in self.shards.ranks]

    def __call__(self, x: Tensor) -> Tensor:
        return self.shards.reduce(self.partials(x), self.site)


class TPAttention(_RowParallel):
    """KDA/MLA stand-in with tensor-parallel heads: h = tanh (KDA) or sin (MLA) of a projection of a slice of x,
    rank r's heads are columns K_r, the output projection is row-parallel. Under TP with the one-shot ops the
    output is this rank's partial (a PendingPartial): the pre-MLP site all-reduces it inside its fused op."""

    def __call__(self, x: Tensor):
        return self.shards.defer(self.partials(x), "attention")

    def __init__(self, config: KimiK3Config, layer: int, pool: WeightPool, shards: Shards, device):
        super().__init__(shards, config.standin_rank)
        rnd = _LayerRandom(config, layer, role=_ROLE_ATTN, device=device)
        H, r = config.hidden_size, config.standin_rank
        self.full = config.is_full_attention_layer(layer)
        self.start, self.r = rnd.offset(H, r), r
        qkv, out = pool.square[layer % _POOL_SQUARE], pool.wide[layer % _POOL_WIDE]
        self.gain = rnd.vec(H, 0.6, 0.1)
        self.w_in = {k: qkv[:, c.start:c.stop].contiguous() for k, c in self.columns.items()}
        self.w_out = {k: out[c.start:c.stop].contiguous() for k, c in self.columns.items()}

    def partial(self, x: Tensor, rank: int) -> Tensor:
        h = _slice(x, self.start, self.r) @ self.w_in[rank]
        h = torch.sin(h) if self.full else torch.tanh(h)
        return ((h @ self.w_out[rank]) * self.gain).to(BF16)


class TPDenseMLP(_RowParallel):
    """Layer 0's gated MLP: gate and up column-parallel, down row-parallel."""

    site = "dense_mlp"

    def __init__(self, config: KimiK3Config, layer: int, pool: WeightPool, shards: Shards, device):
        super().__init__(shards, config.standin_rank)
        rnd = _LayerRandom(config, layer, role=_ROLE_DENSE, device=device)
        H, r = config.hidden_size, config.standin_rank
        self.start, self.r = rnd.offset(H, r), r
        gate, up = pool.square[layer % _POOL_SQUARE], pool.square[(layer + 1) % _POOL_SQUARE]
        down = pool.wide[(layer + 2) % _POOL_WIDE]
        self.gain = rnd.vec(H, 0.8, 0.1)
        self.w_gate = {k: gate[:, c.start:c.stop].contiguous() for k, c in self.columns.items()}
        self.w_up = {k: up[:, c.start:c.stop].contiguous() for k, c in self.columns.items()}
        self.w_down = {k: down[c.start:c.stop].contiguous() for k, c in self.columns.items()}

    def partial(self, y: Tensor, rank: int) -> Tensor:
        s = _slice(y, self.start, self.r)
        h = torch.nn.functional.silu(s @ self.w_gate[rank]) * (s @ self.w_up[rank])
        return ((h @ self.w_down[rank]) * self.gain).to(BF16)


class TPSharedExpert(_RowParallel):
    """The shared experts (one gated MLP) under TP: row-parallel down-projection."""

    def __init__(self, config: KimiK3Config, layer: int, pool: WeightPool, shards: Shards, rnd: _LayerRandom):
        super().__init__(shards, config.standin_rank)
        H, r = config.hidden_size, config.standin_rank
        self.start, self.r = rnd.offset(H, r), r
        gate, down = pool.square[(layer + 2) % _POOL_SQUARE], pool.wide[(layer + 4) % _POOL_WIDE]
        self.gain = rnd.vec(H, 0.5, 0.1)
        self.w_gate = {k: gate[:, c.start:c.stop].contiguous() for k, c in self.columns.items()}
        self.w_down = {k: down[c.start:c.stop].contiguous() for k, c in self.columns.items()}

    def partial(self, y: Tensor, rank: int) -> Tensor:
        s = _slice(y, self.start, self.r)
        cols = self.columns[rank]
        h = torch.nn.functional.silu(s @ self.w_gate[rank]) * s[:, cols.start:cols.stop]
        return ((h @ self.w_down[rank]) * self.gain).to(BF16)


# ------------------------------------------------------------------------------------------ routed experts
@dataclass(frozen=True)
class LocalPieces:
    """One rank's deferred-finalize hand-off (the inputs of attnres.moe_finalize)."""

    rows: Tensor  # [R, D] bf16, this rank's expert output rows grouped by expert, NaN padding
    weights: Tensor  # [T, k] fp32, the routing weights (every rank holds all of them)
    index: Tensor  # [T, k] int32: row of route (t, j) on this rank, -1 where the expert is remote


def permuted_rows(expert_rows: Callable[[int, Tensor], Tensor], tokens: int, topk_ids: Tensor, owned: range,
                  width: int, device, align: int = FINALIZE_ALIGN) -> tuple[Tensor, Tensor]:
    """A MoE runner's permuted output for the experts in `owned`: each owned expert's routes, token-major,
    in one segment padded to `align` rows (NaN padding, plus `align` tail rows), and the index map (-1 for a
    route whose expert is not owned). expert_rows(e, token_ids) -> [n, width] bf16."""
    T, k = topk_ids.shape
    ids = topk_ids.long().cpu()
    index = torch.full((T, k), -1, dtype=torch.int32)
    segments, next_row = [], 0
    for e in owned:
        t_ids, j_ids = (ids == e).nonzero(as_tuple=True)  # row-major: (t, j) ascending
        if t_ids.numel() == 0:
            continue
        index[t_ids, j_ids] = torch.arange(next_row, next_row + t_ids.numel(), dtype=torch.int32)
        segments.append((e, next_row, t_ids))
        next_row += -(-t_ids.numel() // align) * align
    rows = torch.full((next_row + align, width), float("nan"), dtype=BF16, device=device)
    for e, first, t_ids in segments:
        rows[first:first + t_ids.numel()] = expert_rows(e, t_ids.to(device))
    return rows, index.to(device)


class StandInRoutedExperts:
    """Routing over E experts (softmax, top-k, renormalized, fp32 weights) and elementwise stand-in experts in a
    latent of width D: expert e maps a latent row z to bf16(silu(z * scale_e + bias_e)). Hands each rank the
    pieces of its experts (a contiguous share of 0..E-1)."""

    def __init__(self, latent: int, num_experts: int, top_k: int, router_width: int, rnd: _LayerRandom):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"StandInRoutedExperts: top_k must be in [1, {num_experts}], got {top_k}")
        self.latent, self.num_experts, self.top_k = latent, num_experts, top_k
        self.router_width = min(router_width, latent)
        self.router = rnd.mat(self.router_width, num_experts, 1.0 / math.sqrt(self.router_width))
        self.scale = rnd.mat(num_experts, latent, 1.0)
        self.bias = rnd.mat(num_experts, latent, 0.2)

    def route(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """(weights [T, k] fp32, ids [T, k] int32) for latent rows z [T, D] (fp32)."""
        probs = torch.softmax(z[:, :self.router_width] @ self.router, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)

    def owned(self, rank: int, world_size: int) -> range:
        return shard_range(self.num_experts, world_size, rank)

    def pieces(self, z: Tensor, weights: Tensor, ids: Tensor, owned: range) -> LocalPieces:
        def expert_rows(e: int, t_ids: Tensor) -> Tensor:
            return torch.nn.functional.silu(z[t_ids] * self.scale[e] + self.bias[e]).to(BF16)

        rows, index = permuted_rows(expert_rows, z.shape[0], ids, owned, self.latent, z.device)
        return LocalPieces(rows, weights, index)


def finalize_partial(pieces: LocalPieces, scale: float = ROUTED_SCALE) -> Tensor:
    """A rank's finalize on its local routes: attnres.moe_finalize without the norm (remote routes, -1, are
    skipped). The result is a partial of the latent: the norm must wait for the all-reduce."""
    return attnres.moe_finalize(pieces.rows, pieces.weights, pieces.index, eps=0.0, scale=scale)


def finalize_tp(pieces: list[LocalPieces], shards: Shards, norm_weight: Tensor, eps: float,
                scale: float = ROUTED_SCALE) -> tuple[Tensor, Tensor]:
    """The finalize under TP: per rank of shards.ranks the local-route finalize, then the all-reduce (the
    partials joined), then the latent RMSNorm (two roundings, as moe_finalize's own norm). Returns (the reduced
    latent, the normed latent)."""
    if shards.all_reduce is not None and len(pieces) == 1:
        p = pieces[0]
        T, k = p.index.shape
        D = p.rows.shape[1]
        probe = p.rows.new_empty((T, D)) if p.rows.dim() == 2 else p.rows
        comm, why = shards._comm(probe, latent=True)
        if comm is not None:
            gate = shards.fused.moe_max_tokens
            ok, why = supports_moe_finalize_all_reduce(T, k, D, shards.world_size, (p.rows.dtype, p.weights.dtype),
                                                       p.rows.device, max_tokens=gate)
            if ok:
                # One launch: the local-route combine, the all-reduce of the latent, the two-rounding norm.
                shards._note("moe_finalize", FUSED, "", probe)
                return attnres.moe_finalize_all_reduce(comm, p.rows, p.weights, p.index, norm_weight, eps=eps,
                                                       scale=scale)
        shards._note("moe_finalize", FALLBACK, why, probe)
        latent = shards.all_reduce(finalize_partial(p, scale))
        return latent, rmsnorm(latent, norm_weight, eps)
    latent = shards.reduce([finalize_partial(p, scale) for p in pieces], "moe_finalize")
    return latent, rmsnorm(latent, norm_weight, eps)


class TPMoE:
    """Kimi K3's MoE under TP, as a stand-in. Latent z = a D-wide slice of y (the down-projection's stand-in,
    replicated); routing replicated; each rank runs its own experts and the finalize on its local routes; the
    latent partials are all-reduced, normed (latent RMSNorm), and up-projected (replicated: a slice of the normed
    latent through an [r, H] matrix) into the routed output. The shared expert is row-parallel and all-reduced.
    Both parts come back reduced, so `return_parts=True` hands the fold the same tensors the sum uses."""

    def __init__(self, config: KimiK3Config, layer: int, pool: WeightPool, shards: Shards, device):
        rnd = _LayerRandom(config, layer, role=_ROLE_MOE, device=device)
        H, r = config.hidden_size, config.standin_rank
        self.shards = shards
        self.D = latent_width(config)
        self.start = rnd.offset(H, self.D)
        self.experts = StandInRoutedExperts(self.D, config.standin_experts, config.standin_top_k, r, rnd)
        if self.experts.num_experts < shards.world_size:
            raise ValueError(f"TPMoE: {self.experts.num_experts} experts cannot be split over "
                             f"{shards.world_size} ranks")
        self.norm_weight = rnd.vec(self.D, 1.0, 0.1).to(BF16)  # the latent RMSNorm weight, a bf16 parameter
        self.eps = config.norm_eps
        self.up_width = min(r, self.D)
        self.up = pool.wide[(layer + 3) % _POOL_WIDE][:self.up_width]
        self.routed_gain = rnd.vec(H, 0.7, 0.15)
        self.shared_expert = TPSharedExpert(config, layer, pool, shards, rnd)

    def latent_input(self, y: Tensor) -> Tensor:
        return _slice(y, self.start, self.D)

    def local_pieces(self, y: Tensor, rank: int) -> LocalPieces:
        """Rank `rank`'s hand-off for input y (what its MoE runner returns with do_finalize=False)."""
        z = self.latent_input(y)
        weights, ids = self.experts.route(z)
        return self.experts.pieces(z, weights, ids, self.experts.owned(rank, self.shards.world_size))

    def all_pieces(self, y: Tensor) -> LocalPieces:
        """The same routing with every expert local (TP = 1): the whole finalize's pieces."""
        z = self.latent_input(y)
        weights, ids = self.experts.route(z)
        return self.experts.pieces(z, weights, ids, range(self.experts.num_experts))

    def latent(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """(reduced latent, normed latent): the finalize of every rank's local routes, all-reduced, normed."""
        return finalize_tp([self.local_pieces(y, r) for r in self.shards.ranks], self.shards, self.norm_weight,
                           self.eps)

    def routed_from_latent(self, normed: Tensor) -> Tensor:
        return ((normed[:, :self.up_width].float() @ self.up) * self.routed_gain).to(BF16)

    def routed(self, y: Tensor) -> Tensor:
        return self.routed_from_latent(self.latent(y)[1])

    def shared(self, y: Tensor) -> Tensor:
        return self.shards.reduce(self.shared_expert.partials(y), "shared")

    def __call__(self, y: Tensor, *, return_parts: bool = False):
        """routed + shared (one bf16 add of the two reduced parts), or (routed, shared) for the fold: under TP
        with the one-shot ops `shared` is then this rank's partial (a PendingPartial) that the fold site
        all-reduces inside its fused op (site add2), or reduces first where it cannot fold."""
        routed = self.routed(y)
        if return_parts:
            return routed, self.shards.defer(self.shared_expert.partials(y), "shared")
        return routed + self.shared(y)


# ------------------------------------------------------------------------------------------ the model
def tensor_parallel_model(config: KimiK3Config, shards: Shards, *, settings: ResidualSettings | None = None,
                          device="cpu", keep_paths: bool = True) -> KimiK3Model:
    """A KimiK3Model (the same decoder, sites, fold and site weights) whose sub-layers are the tensor-parallel
    stand-ins of `shards`. Weights are drawn on the CPU from the config's seed, so every rank (and the TP = 1
    reference) holds the same values."""
    model = KimiK3Model(config, settings=settings, device=device, keep_paths=keep_paths)
    pool = WeightPool(config, model.device)
    for layer in model.layers:
        layer.attention = TPAttention(config, layer.layer, pool, shards, model.device)
        layer.mlp = (TPMoE(config, layer.layer, pool, shards, model.device) if layer.is_moe
                     else TPDenseMLP(config, layer.layer, pool, shards, model.device))
    model.shards = shards
    return model


def unit_roundoff(dtype: torch.dtype = BF16) -> float:
    """u = 2^-p for a p-bit significand (bf16: 2^-8): one rounding to nearest errs by at most u * |value|."""
    return {BF16: 2.0 ** -8, torch.float32: 2.0 ** -24}[dtype]


def finalize_split_bound(partials: list[Tensor], exact: Tensor) -> Tensor:
    """Elementwise bound on |TP finalize latent - TP = 1 finalize latent| (before the norm). TP = 1 rounds the
    exact sum S once: error <= u|S|. TP rounds each rank's partial P_r (<= u|P_r|), then the all-reduce adds
    the rounded partials (with W ranks, W - 1 roundings of running sums <= u|S| each, to first order). So
    |TP - TP1| <= u (sum_r |P_r| + W |S|), to first order in u; the bound takes 1 % on top."""
    u = unit_roundoff()
    p = sum(t.detach().double().abs().cpu() for t in partials) * (1 + u)
    return 1.01 * u * (p + len(partials) * exact.detach().double().abs().cpu())
