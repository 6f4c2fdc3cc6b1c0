"""The FP8 (e4m3) output of the normed ops: modes, the scales' memory layout, and the reference quantization.

`quantize(x, mode, pow2)` is the definition the fused epilogue matches bit for bit (docs/ops/attn_res_rmsnorm.md,
"FP8 output"), written with plain torch ops so that tests and users can apply it to any bf16 tensor:

    amax = max |x| per group (a token, or 128 columns of a token), in fp32, NaN-propagating
    s    = max(amax, 1e-10) / 448                     (IEEE fp32 division; NaN amax -> NaN 0x7FC00000)
    pow2: s = 2^ceil(log2 s) from s's bits            (UE8M0-valued; inf and NaN unchanged)
    q    = e4m3(clamp(x / s, -448, 448))              (IEEE fp32 division, round to nearest even, NaN -> 0x7F)
"""

from __future__ import annotations

import torch
from torch import Tensor

MODES = ("per_token", "block128")
GROUP = 128  # columns per scale in block128 mode
FP8_MAX = 448.0
MIN_AMAX = 1e-10
NAN_CODE = 0x7F


def scale_groups(mode: str, hidden):
    return 1 if mode == "per_token" else hidden // GROUP


def empty_scales(mode: str, tokens, hidden, device) -> Tensor:
    """fp32 scales [T, G] in the layout the ops write: per_token [T, 1] contiguous; block128 [T, H / 128]
    column-major over tokens with the token stride padded to a multiple of 4 (DeepGEMM's Hopper layout:
    strides (1, round_up(T, 4)))."""
    if mode == "per_token":
        return torch.empty((tokens, 1), dtype=torch.float32, device=device)
    padded = (tokens + 3) // 4 * 4
    return torch.empty_strided((tokens, hidden // GROUP), (1, padded), dtype=torch.float32, device=device)


def _bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32)


def quantize(x: Tensor, mode: str, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """(codes [T, H] float8_e4m3fn, scales [T, G] float32 contiguous) of a [T, H] tensor, on x's device."""
    if mode not in MODES:
        raise ValueError(f"fp8.quantize: mode must be one of {MODES}, got {mode!r}")
    T, H = x.shape
    g = H if mode == "per_token" else GROUP
    if H % g:
        raise ValueError(f"fp8.quantize: block128 needs H a multiple of {GROUP}, got {H}")
    x32 = x.float().reshape(T, H // g, g)
    # |x| as bit patterns: their max is the NaN-propagating amax (NaN > inf > every finite magnitude).
    amax_bits = (_bits(x32) & 0x7FFFFFFF).amax(-1)
    amax = amax_bits.view(torch.float32)
    floor = torch.full_like(amax, MIN_AMAX)
    s = torch.where(amax > floor, amax, floor) / torch.full_like(amax, FP8_MAX)  # tensor / tensor: IEEE division
    if pow2:
        b = _bits(s)
        up = (b & 0x7F800000) + 0x00800000
        b = torch.where((b & 0x007FFFFF) != 0, up, b)
        s = b.view(torch.float32)
    s = torch.where(amax_bits > 0x7F800000, torch.full_like(s, float("nan")), s)
    s = _bits(s).masked_fill(torch.isnan(s), 0x7FC00000).view(torch.float32)  # one NaN pattern
    v = x32 / s.unsqueeze(-1)
    v = torch.clamp(v, -FP8_MAX, FP8_MAX)  # keeps NaN
    codes = v.to(torch.float8_e4m3fn).view(torch.uint8)
    codes = codes.masked_fill(torch.isnan(v), NAN_CODE)
    return codes.reshape(T, H).view(torch.float8_e4m3fn), s.reshape(T, H // g)
