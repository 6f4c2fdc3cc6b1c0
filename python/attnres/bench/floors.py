"""The floors the op is measured against: copy bandwidth and the one-tiny-kernel-per-graph-node launch floor."""

from __future__ import annotations

import torch

from .timing import capture, time_interleaved


def copy_bandwidth_tbs(megabytes: int = 2048, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    n = megabytes * 1024 * 1024 // 2
    src = torch.randn(n, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    g = capture([lambda: dst.copy_(src)])
    t = time_interleaved({"copy": (g, 1)}, repeats=repeats)["copy"]
    return 2 * n * 2 / (t.median_us * 1e-6) / 1e12


def launch_floor_us(calls: int = 200, repeats: int = 25) -> dict:
    """Per-node time of a graph of tiny kernels (one 1-element fill each)."""
    cells = [torch.empty(1, device="cuda") for _ in range(calls)]
    g = capture([lambda c=c: c.fill_(1.0) for c in cells])
    return time_interleaved({"launch": (g, calls)}, repeats=repeats)["launch"].as_dict()
