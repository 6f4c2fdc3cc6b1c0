"""Kimi K3's decoder layer and model in decode: the residual stream exactly as docs/model.md's per-layer
sequence, with stand-in sub-layers. Per layer L (prefix P, S snapshots in the bank):

1. pre-attention site: x = norm_in(AttnRes(P, bank[:S])) — a plain RMSNorm at layer 0 (S = 0); a pending MoE
   tail from layer L - 1 is consumed here;
2. snapshot layer (L % block == 0): P goes into bank row S (through the fused op's snapshot_slot when the
   fold runs, else a copy), S += 1, and the prefix restarts;
3. a = attention(x);
4. pre-MLP site: on a snapshot layer P = a and y = norm_post(AttnRes(P, bank[:S])); otherwise
   (P, y) = attn_res_add_rmsnorm(P, a, bank[:S]);
5. m = mlp(y) — on MoE layers routed + shared, or with the fold a pending tail (P, routed, shared);
6. P = P + m. After the last layer: out = norm(AttnRes(P, bank[:Kmax])).

With ResidualSettings.fp8 the pre-attention and pre-MLP sites (inputs of the attention and MLP projections)
also produce x and y quantized to e4m3 (SiteResult.fp8, traced); the stand-in sub-layers consume the bf16 x, y.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import KimiK3Config
from .residual import (DEFER, BF16, PathRecord, PendingPartial, PendingTail, ResidualSettings, SiteWeights, SnapshotBank,
                       attn_res_add_site, attn_res_site, check_fp8_hidden, reduced, tail_route)
from .sublayers import StandInAttention, StandInDenseMLP, StandInMoE, WeightPool
from .trace import ChainTrace

# Seed roles of the site weights.
_PRE_ATTN, _PRE_MLP, _OUTPUT = 11, 12, 13


def _site_weights(config: KimiK3Config, layer: int, role: int, device) -> SiteWeights:
    """Random stand-ins for a site's three parameter rows (bf16): the pseudo-query at ~0.02 scale, gains
    around 1."""
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + layer * 101 + role * 7 + 5)
    H = config.hidden_size
    res = 0.02 * torch.randn(H, generator=g)
    rms = 1.0 + 0.1 * torch.randn(H, generator=g)
    norm = 1.0 + 0.1 * torch.randn(H, generator=g)
    return SiteWeights(res.to(BF16).to(device), rms.to(BF16).to(device), norm.to(BF16).to(device),
                       config.rms_eps, config.norm_eps)


class DecodeStep:
    """One forward's residual state: the bank, the snapshot count, the taps, and where decisions go."""

    def __init__(self, config: KimiK3Config, settings: ResidualSettings, bank: SnapshotBank, record: PathRecord,
                 trace: ChainTrace | None):
        self.config, self.settings, self.bank, self.record, self.trace = config, settings, bank, record, trace
        self.num_snapshots = 0
        self.taps: dict[int, Tensor] = {}

    def _tap(self, layer: int, site) -> Tensor:
        tap = site.mixture if self.settings.aux_stream else site.prefix
        self.taps[layer] = tap
        return tap

    def pre_attention(self, layer: int, carried: Tensor | PendingTail, w: SiteWeights) -> tuple[Tensor, Tensor]:
        cfg = self.config
        name = f"layer{layer}.pre_attn"
        snapshot = cfg.is_snapshot_layer(layer)
        tap_layer = cfg.tap_layer_at(layer)
        site = attn_res_site(carried, self.bank, self.num_snapshots, w, self.settings, site=name,
                             mixture=tap_layer is not None and self.settings.aux_stream, snapshot=snapshot,
                             fp8=True, record=self.record)
        if snapshot:
            self.num_snapshots += 1
        tap = self._tap(tap_layer, site) if tap_layer is not None else None
        if self.trace is not None:
            self.trace.site(name, site.prefix, site.output, tap, fp8=site.fp8)
        return site.prefix, site.output

    def pre_mlp(self, layer: int, prefix: Tensor, attn_out: Tensor | PendingPartial, w: SiteWeights) -> tuple[Tensor, Tensor]:
        name = f"layer{layer}.pre_mlp"
        k = self.num_snapshots
        if self.config.is_snapshot_layer(layer):
            # The prefix restarted at the snapshot: the attention output is the whole new prefix.
            site = attn_res_site(reduced(attn_out), self.bank, k, w, self.settings, site=name, fp8=True,
                                 record=self.record)
        else:
            site = attn_res_add_site(prefix, attn_out, self.bank, k, w, self.settings, site=name, fp8=True,
                                     record=self.record)
        if self.trace is not None:
            self.trace.site(name, site.prefix, site.output, fp8=site.fp8)
        return site.prefix, site.output

    def moe_tail(self, layer: int, prefix: Tensor, moe: StandInMoE, y: Tensor) -> Tensor | PendingTail:
        T, H = prefix.shape
        route = tail_route(self.settings, tokens=T, hidden=H, dtype=prefix.dtype)
        self.record.add(f"layer{layer}.moe_tail", route, T, self.num_snapshots + 1)
        if route.path == DEFER:
            routed, shared = moe(y, return_parts=True)
            return PendingTail(prefix, routed, shared)
        return prefix + moe(y)  # moe(y) = routed + shared: the eager chain's two bf16 adds

    def output(self, carried: Tensor | PendingTail, w: SiteWeights) -> Tensor:
        cfg = self.config
        final = cfg.final_layer_captured
        site = attn_res_site(carried, self.bank, self.num_snapshots, w, self.settings, site="output",
                             mixture=final and self.settings.aux_stream, final_capture=final, record=self.record)
        # The last layer's tap: its next consumer is the output site, so the tap uses the output site's weights.
        tap = self._tap(cfg.num_layers - 1, site) if final else None
        if self.trace is not None:
            self.trace.site("output", site.prefix, site.output, tap)
        return site.output


class KimiK3DecoderLayer:
    def __init__(self, config: KimiK3Config, layer: int, pool: WeightPool, device):
        self.layer = layer
        self.is_moe = config.is_moe_layer(layer)
        # self_attention_res_proj / self_attention_res_norm / the input RMSNorm
        self.attn_site = _site_weights(config, layer, _PRE_ATTN, device)
        # mlp_res_proj / mlp_res_norm / the post-attention RMSNorm
        self.mlp_site = _site_weights(config, layer, _PRE_MLP, device)
        self.attention = StandInAttention(config, layer, pool, device)
        self.mlp = StandInMoE(config, layer, pool, device) if self.is_moe else StandInDenseMLP(config, layer, pool,
                                                                                              device)

    def forward(self, carried: Tensor | PendingTail, step: DecodeStep) -> Tensor | PendingTail:
        prefix, x = step.pre_attention(self.layer, carried, self.attn_site)
        a = self.attention(x)
        prefix, y = step.pre_mlp(self.layer, prefix, a, self.mlp_site)
        if self.is_moe:
            return step.moe_tail(self.layer, prefix, self.mlp, y)
        return prefix + self.mlp(y)

    __call__ = forward


@dataclass
class KimiK3Output:
    output: Tensor  # [T, H] bf16: norm(AttnRes(P, bank)) at the model output
    taps: dict[int, Tensor]  # captured layer -> its tap [T, H]
    bank: SnapshotBank
    num_snapshots: int


class KimiK3Model:
    """The decoder stack. `settings` default to the knobs (attnres.knobs.CURRENT, read at the first build); assign
    `model.settings` to run the same weights another way. `model.paths` records every site's decision."""

    def __init__(self, config: KimiK3Config, *, settings: ResidualSettings | None = None, device="cpu",
                 keep_paths: bool = True):
        self.config = config
        self.device = torch.device(device)
        self.settings = settings if settings is not None else ResidualSettings.from_knobs()
        pool = WeightPool(config, self.device)
        self.layers = [KimiK3DecoderLayer(config, layer, pool, self.device) for layer in range(config.num_layers)]
        # output_attn_res_proj / output_attn_res_norm / the final norm
        self.output_site = _site_weights(config, config.num_layers, _OUTPUT, self.device)
        self.paths = PathRecord(keep=keep_paths)

    def allocate_bank(self, tokens: int, *, fill: float | None = None) -> SnapshotBank:
        cfg = self.config
        return SnapshotBank.allocate(cfg.num_snapshots, tokens, cfg.hidden_size, layout=cfg.bank_layout,
                                     device=self.device, fill=fill)

    def embed(self, tokens: int, step: int = 0) -> Tensor:
        """Stand-in embeddings for a decode step: [T, H] bf16, deterministic in (seed, step)."""
        g = torch.Generator().manual_seed(self.config.seed * 7919 + step * 104729 + tokens)
        return torch.randn(tokens, self.config.hidden_size, generator=g).to(BF16).to(self.device)

    def forward(self, hidden_states: Tensor | PendingTail, *, bank: SnapshotBank | None = None,
                trace: ChainTrace | None = None) -> KimiK3Output:
        """One decode step. `hidden_states`: [T, H] bf16 (or a PendingTail a caller hands in: the first site has
        no snapshot yet, so it is materialized first). `bank`: a preallocated bank to write (rebuilt every
        step; allocated here when None)."""
        cfg = self.config
        first = hidden_states.prefix if isinstance(hidden_states, PendingTail) else hidden_states
        if first.dim() != 2 or first.shape[1] != cfg.hidden_size or first.dtype != BF16:
            raise ValueError(f"KimiK3Model: hidden_states must be [T, {cfg.hidden_size}] bf16, got "
                             f"{tuple(first.shape)} {first.dtype}")
        if isinstance(hidden_states, PendingTail) and any(
                t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in hidden_states):
            raise ValueError("KimiK3Model: a pending input's prefix, routed and shared must agree in shape, dtype "
                             "and device")
        check_fp8_hidden(self.settings, cfg.hidden_size)
        T = first.shape[0]
        if bank is None:
            bank = self.allocate_bank(T)
        elif bank.rows < cfg.num_snapshots or bank.tokens != T or bank.storage.shape[-1] != cfg.hidden_size:
            raise ValueError(f"KimiK3Model: the bank must hold >= {cfg.num_snapshots} rows of [{T}, "
                             f"{cfg.hidden_size}]")
        step = DecodeStep(cfg, self.settings, bank, self.paths, trace)
        carried = hidden_states
        for layer in self.layers:
            carried = layer(carried, step)
            if trace is not None:
                trace.layer_end(layer.layer, bank.storage)
        output = step.output(carried, self.output_site)
        return KimiK3Output(output, dict(sorted(step.taps.items())), bank, step.num_snapshots)

    __call__ = forward
