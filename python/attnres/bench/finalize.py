"""The MoE finalize gate benchmark (seed 004): attnres.moe_finalize against the unfused PyTorch sequence a
user would write (gather, weight, fp32 sum, round, + shared, two-rounding RMSNorm), at Kimi K3's latent
shape k = 16, D = 3584, T in {1, 2, 4, 8, 16} (and beyond, to see where the gate should sit). Same run,
interleaved, CUDA-graph replay over rotating inputs. Its results set ATTNRES_MOE_FINALIZE_MAX_TOKENS."""

from __future__ import annotations

import torch

from attnres.moe import moe_finalize, unfused_moe_finalize

from .timing import capture, rotating_sets, time_interleaved

K, D = 16, 3584


def input_sets(T: int, count: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(count):
        R = T * K + 8  # permuted rows with padding, as a MoE runner leaves them
        rows = torch.randn(R, D, generator=g, device="cuda").to(torch.bfloat16)
        weights = torch.softmax(torch.randn(T, K, generator=g, device="cuda"), dim=-1)
        index = torch.randperm(R, generator=g, device="cuda")[: T * K].reshape(T, K).to(torch.int32)
        index[:, -2:] = -1  # routes owned by another rank
        shared = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
        norm_weight = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).to(torch.bfloat16)
        sets.append((rows, weights, index, shared, norm_weight))
    return sets


def run(quick: bool = False, progress=None, repeats: int = 25) -> list[dict]:
    tokens = (1, 2, 4, 8, 16) if quick else (1, 2, 3, 4, 6, 8, 12, 16, 32)
    records = []
    for i, T in enumerate(tokens):
        bytes_per_set = (T * K + 8) * D * 2 + T * K * 8 + T * D * 2 * 2 + D * 2
        sets = input_sets(T, rotating_sets(bytes_per_set), seed=T)
        graphs = {
            "attnres/moe_finalize": (capture([lambda s=s: moe_finalize(s[0], s[1], s[2], shared=s[3], norm_weight=s[4],
                                                                       eps=1e-5) for s in sets]), len(sets)),
            "unfused_torch": (capture([lambda s=s: unfused_moe_finalize(s[0], s[1], s[2], shared=s[3],
                                                                        norm_weight=s[4], eps=1e-5) for s in sets]),
                              len(sets)),
        }
        for name, t in time_interleaved(graphs, repeats=repeats).items():
            records.append({"suite": "finalize", "provider": name, "T": T, "k": K, "D": D, "sets": len(sets),
                            **t.as_dict()})
        if progress:
            progress(i + 1, len(tokens), f"finalize T={T}")
    return records
