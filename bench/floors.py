"""The floors the op is measured against: copy bandwidth and the one-tiny-kernel-per-graph-node launch floor."""

from __future__ import annotations

import time

import torch

from attnres.bench.timing import capture, time_interleaved


def copy_bandwidth_tbs(megabytes: int = 2048, repeats: int = 10, warmup_s: float = 1.0, rounds: int = 3) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (TB/s): the faster of `copy_`
    (cudaMemcpyAsync) and an elementwise kernel over the SMs (`mul(src, 1)`: one read and one write per element,
    what a streaming kernel competes with), best median of `rounds` timings after `warmup_s` seconds of both.
    `copy_` alone read 2.77 TB/s on the H200, warmed up or not, which made the persistent kernel look like 87 %
    of the device's rate; an SM copy is reported there at 4.2-4.3 TB/s."""
    n = megabytes * 1024 * 1024 // 2
    src = torch.randn(n, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    graphs = {"memcpy": (capture([lambda: dst.copy_(src)]), 1),
              "kernel": (capture([lambda: torch.mul(src, 1, out=dst)]), 1)}
    end = time.perf_counter() + warmup_s
    while time.perf_counter() < end:
        for g, _ in graphs.values():
            g.replay()
        torch.cuda.synchronize()
    best_us = min(t.median_us for _ in range(rounds) for t in time_interleaved(graphs, repeats=repeats).values())
    return 2 * n * 2 / (best_us * 1e-6) / 1e12


def launch_floor_us(calls: int = 200, repeats: int = 25) -> dict:
    """Per-node time of a graph of tiny kernels (one 1-element fill each)."""
    cells = [torch.empty(1, device="cuda") for _ in range(calls)]
    g = capture([lambda c=c: c.fill_(1.0) for c in cells])
    return time_interleaved({"launch": (g, calls)}, repeats=repeats)["launch"].as_dict()
