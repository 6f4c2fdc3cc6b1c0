"""Stand-in sub-layers: deterministic, seeded, cheap functions with Kimi K3's interfaces ([T, H] bf16 in,
[T, H] bf16 out) in place of KDA/MLA attention, the dense MLP and the MoE (the real ones need the ~1.5 TB
checkpoint and are out of scope). What matters for the residual stream is that their outputs are realistic
bf16 rows (unit-scale, dense, different per layer and per token) and that the MoE runtime can hand back its
routed and shared parts unsummed.

Each reads a low-rank slice of its input through fp32 matmuls with bf16-valued weights and rounds its result
to bf16 once, as a real kernel's epilogue would. Large matrices come from a small shared pool (the real
93-layer, H = 7168 schedule stays at tens of MB); per-layer gains and slice offsets make every layer differ.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import KimiK3Config

_POOL_WIDE = 6  # [r, H] matrices
_POOL_SQUARE = 4  # [r, r] matrices


def _bf16_values(t: Tensor) -> Tensor:
    """fp32 tensor holding bf16-representable values (weights as a bf16 checkpoint stores them)."""
    return t.to(torch.bfloat16).float()


class WeightPool:
    """The shared matrices, generated on the CPU from the config's seed (so every device gets the same
    values) and moved to `device` once."""

    def __init__(self, config: KimiK3Config, device):
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + 17)
        H, r = config.hidden_size, config.standin_rank
        self.wide = [_bf16_values(torch.randn(r, H, generator=g) / math.sqrt(r)).to(device) for _ in range(_POOL_WIDE)]
        self.square = [_bf16_values(torch.randn(r, r, generator=g) / math.sqrt(r)).to(device)
                       for _ in range(_POOL_SQUARE)]


class _LayerRandom:
    """Per-layer random vectors from a generator seeded by (config seed, layer, role)."""

    def __init__(self, config: KimiK3Config, layer: int, role: int, device):
        self.g = torch.Generator().manual_seed(config.seed * 1_000_003 + layer * 101 + role * 7 + 1)
        self.device = device

    def vec(self, n: int, mean: float, std: float) -> Tensor:
        return _bf16_values(mean + std * torch.randn(n, generator=self.g)).to(self.device)

    def mat(self, rows: int, cols: int, std: float) -> Tensor:
        return _bf16_values(std * torch.randn(rows, cols, generator=self.g)).to(self.device)

    def offset(self, H: int, r: int) -> int:
        """A slice start, a multiple of 8 (so slices stay 16-byte aligned)."""
        slots = (H - r) // 8 + 1
        return 8 * int(torch.randint(slots, (1,), generator=self.g))


def _slice(x: Tensor, start: int, r: int) -> Tensor:
    return x[:, start:start + r].float()


class StandInAttention:
    """KDA (linear attention) or MLA (full attention) stand-in: a fixed random projection of a slice of x
    through a per-kind nonlinearity, plus a per-channel share of x itself."""

    def __init__(self, config: KimiK3Config, layer: int, pool: WeightPool, device):
        rnd = _LayerRandom(config, layer, role=1, device=device)
        H, r = config.hidden_size, config.standin_rank
        self.full = config.is_full_attention_layer(layer)
        self.start = rnd.offset(H, r)
        self.proj = pool.wide[layer % _POOL_WIDE]
        self.gain = rnd.vec(H, 0.6, 0.1)
        self.skip = rnd.vec(H, 0.0, 0.3)
        self.r = r

    def __call__(self, x: Tensor) -> Tensor:
        h = _slice(x, self.start, self.r) @ self.proj
        h = torch.sin(h) if self.full else torch.tanh(h)
        return (h * self.gain + x.float() * self.skip).to(torch.bfloat16)


class StandInDenseMLP:
    """Layer 0's dense gated MLP stand-in: silu(gate) * up in the slice, then a projection back to H."""

    def __init__(self, config: KimiK3Config, layer: int, pool: WeightPool, device):
        rnd = _LayerRandom(config, layer, role=2, device=device)
        H, r = config.hidden_size, config.standin_rank
        self.start = rnd.offset(H, r)
        self.gate = pool.square[layer % _POOL_SQUARE]
        self.up = pool.square[(layer + 1) % _POOL_SQUARE]
        self.down = pool.wide[(layer + 2) % _POOL_WIDE]
        self.gain = rnd.vec(H, 0.8, 0.1)
        self.r = r

    def __call__(self, y: Tensor) -> Tensor:
        s = _slice(y, self.start, self.r)
        h = torch.nn.functional.silu(s @ self.gate) * (s @ self.up)
        return ((h @ self.down) * self.gain).to(torch.bfloat16)


class StandInMoE:
    """The MoE runtime stand-in, shaped like Kimi K3's: a router picks top-k of E experts per token; routed
    experts work in a latent slice (down-projection, per-expert elementwise experts, latent RMSNorm,
    up-projection); a shared expert (a gated MLP) runs on every token. The two parts are rounded to bf16
    separately, as the routed finalize and the shared expert's GEMM epilogue produce them."""

    def __init__(self, config: KimiK3Config, layer: int, pool: WeightPool, device):
        rnd = _LayerRandom(config, layer, role=3, device=device)
        H, r, E = config.hidden_size, config.standin_rank, config.standin_experts
        self.start = rnd.offset(H, r)
        self.shared_start = rnd.offset(H, r)
        self.router = rnd.mat(r, E, 1.0 / math.sqrt(r))
        self.expert_scale = rnd.mat(E, r, 1.0)
        self.expert_bias = rnd.mat(E, r, 0.2)
        self.routed_up = pool.wide[(layer + 3) % _POOL_WIDE]
        self.routed_gain = rnd.vec(H, 0.7, 0.15)
        self.shared_gate = pool.square[(layer + 2) % _POOL_SQUARE]
        self.shared_up = pool.wide[(layer + 4) % _POOL_WIDE]
        self.shared_gain = rnd.vec(H, 0.5, 0.1)
        self.top_k = config.standin_top_k
        self.r = r
        self.eps = config.norm_eps

    def routed(self, y: Tensor) -> Tensor:
        latent = _slice(y, self.start, self.r)
        weights, experts = torch.topk(torch.softmax(latent @ self.router, dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        h = torch.nn.functional.silu(latent.unsqueeze(1) * self.expert_scale[experts] + self.expert_bias[experts])
        combined = (weights.unsqueeze(-1) * h).sum(1)
        combined = combined * torch.rsqrt(combined.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((combined @ self.routed_up) * self.routed_gain).to(torch.bfloat16)

    def shared(self, y: Tensor) -> Tensor:
        s = _slice(y, self.shared_start, self.r)
        h = torch.nn.functional.silu(s @ self.shared_gate) * s
        return ((h @ self.shared_up) * self.shared_gain).to(torch.bfloat16)

    def __call__(self, y: Tensor, *, return_parts: bool = False):
        """routed + shared (one bf16 add), or with return_parts the unsummed (routed, shared)."""
        routed, shared = self.routed(y), self.shared(y)
        if return_parts:
            return routed, shared
        return routed + shared
