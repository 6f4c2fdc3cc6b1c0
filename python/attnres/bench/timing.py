"""Timing by CUDA-graph replay.

Each benchmark point captures one graph per variant; a graph holds one call per rotating input set, so a
replay walks through more bytes than the L2 holds (cold-ish L2, as in decode where gigabytes of weights
stream between two AttnRes sites). Per-call time = replay time / calls. Variants of one point are replayed
interleaved (A B C A B C ...), so drift hits them equally; the spread (p10..p90) says what is noise.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from ..graphs import capture as capture_call


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    calls: int
    repeats: int

    def as_dict(self) -> dict:
        return {"median_us": self.median_us, "p10_us": self.p10_us, "p90_us": self.p90_us, "min_us": self.min_us,
                "calls": self.calls, "repeats": self.repeats}


def rotating_sets(bytes_per_set: int, minimum: int = 8, maximum: int = 1024) -> int:
    """How many distinct input sets a graph must rotate through for their bytes to exceed twice the L2."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return int(min(maximum, max(minimum, math.ceil(2 * l2 / max(bytes_per_set, 1)))))


def capture(calls: list[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """Runs the calls once eagerly (warm-up: autotuning, lazy init) on a side stream, then captures them."""
    return capture_call(lambda: [c() for c in calls])[0]


def quantile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[idx]


def time_interleaved(graphs: dict[str, tuple[torch.cuda.CUDAGraph | Callable[[], None], int]], repeats: int = 25,
                     warmup: int = 3) -> dict[str, Timing]:
    """graphs: name -> (graph, calls per replay); instead of a graph, a callable that launches the replay on the
    current stream (several graphs on their own streams, joined back). Returns per-call timings, replays
    interleaved by name."""
    replays = {name: (g.replay if isinstance(g, torch.cuda.CUDAGraph) else g) for name, (g, _) in graphs.items()}
    for _ in range(warmup):
        for replay in replays.values():
            replay()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        for name, (_, calls) in graphs.items():
            start.record()
            replays[name]()
            stop.record()
            stop.synchronize()
            samples[name].append(start.elapsed_time(stop) * 1000.0 / calls)
    out = {}
    for name, values in samples.items():
        v = sorted(values)
        out[name] = Timing(statistics.median(v), quantile(v, 0.1), quantile(v, 0.9), v[0], graphs[name][1], repeats)
    return out
