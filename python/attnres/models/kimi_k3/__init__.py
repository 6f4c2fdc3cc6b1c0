"""Kimi K3's decode residual stream on attnres: the snapshot bank, the attention-residual sites, the capture
taps and the MoE-tail fold (docs/model.md), with stand-in attention and MoE sub-layers.

    from attnres.models.kimi_k3 import KimiK3Config, KimiK3Model, ResidualSettings
    model = KimiK3Model(KimiK3Config.real(), device="cuda")        # settings from the knobs
    out = model(model.embed(tokens=4))                              # out.output, out.taps, model.paths
"""

from .config import BANK_LAYOUTS, MAX_CANDIDATES, KimiK3Config, kimi_k3_full_attention_layers
from .decoder import DecodeStep, KimiK3DecoderLayer, KimiK3Model, KimiK3Output
from .residual import (Fp8Output, PathRecord, PendingTail, ResidualSettings, Route, SitePath, SiteResult, SiteWeights,
                       SnapshotBank, attn_res_add_site, attn_res_site, eager_attn_res_rmsnorm, fold_route, rmsnorm,
                       site_route, tail_route, try_fold)
from .sublayers import StandInAttention, StandInDenseMLP, StandInMoE
from .trace import ChainTrace, bitwise_equal, compare_outputs, compare_traces

__all__ = [
    "BANK_LAYOUTS", "MAX_CANDIDATES", "ChainTrace", "DecodeStep", "Fp8Output", "KimiK3Config", "KimiK3DecoderLayer",
    "KimiK3Model", "KimiK3Output", "PathRecord", "PendingTail", "ResidualSettings", "Route", "SitePath",
    "SiteResult", "SiteWeights", "SnapshotBank", "StandInAttention", "StandInDenseMLP", "StandInMoE",
    "attn_res_add_site", "attn_res_site", "bitwise_equal", "compare_outputs", "compare_traces",
    "eager_attn_res_rmsnorm", "fold_route", "kimi_k3_full_attention_layers", "rmsnorm", "site_route",
    "tail_route", "try_fold",
]
