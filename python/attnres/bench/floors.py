"""The floors the op is measured against: copy bandwidth and the one-tiny-kernel-per-graph-node launch floor."""

from __future__ import annotations

import time

import torch

from .timing import capture, time_interleaved


def copy_bandwidth_tbs(megabytes: int = 2048, repeats: int = 10, warmup_s: float = 1.0, rounds: int = 3) -> float:
    """Device-to-device copy of a warmed-up GPU, bytes read + written per second (TB/s): the best median of
    `rounds` timings after `warmup_s` seconds of copies. Timed cold, first thing in a run, the copy read 2.76 TB/s
    on an H200 whose warmed-up copy moves 4.2-4.3 TB/s (the clocks ramp up from idle under load), which made
    every fraction of it look 1.5x better than it is."""
    n = megabytes * 1024 * 1024 // 2
    src = torch.randn(n, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    g = capture([lambda: dst.copy_(src)])
    end = time.perf_counter() + warmup_s
    while time.perf_counter() < end:
        g.replay()
        torch.cuda.synchronize()
    best_us = min(time_interleaved({"copy": (g, 1)}, repeats=repeats)["copy"].median_us for _ in range(rounds))
    return 2 * n * 2 / (best_us * 1e-6) / 1e12


def launch_floor_us(calls: int = 200, repeats: int = 25) -> dict:
    """Per-node time of a graph of tiny kernels (one 1-element fill each)."""
    cells = [torch.empty(1, device="cuda") for _ in range(calls)]
    g = capture([lambda c=c: c.fill_(1.0) for c in cells])
    return time_interleaved({"launch": (g, calls)}, repeats=repeats)["launch"].as_dict()
