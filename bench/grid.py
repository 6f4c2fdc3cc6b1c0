"""What the grid suites' run() share: the run's copy rate, and measuring point after point with progress."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def copy_rate(copy_tbs: float | None) -> float:
    """The copy rate the records' pct_copy is taken against: the caller's, else measured now."""
    if copy_tbs is not None:
        return copy_tbs
    from .floors import copy_bandwidth_tbs

    return copy_bandwidth_tbs()


def measure(points: Sequence[tuple], run_point: Callable[..., list[dict]], label: Callable[..., str],
            progress=None, empty_cache: bool = False) -> list[dict]:
    """run_point(*point) for every point in order, their records concatenated; progress(i, n, label(*point)) after
    each (empty_cache: the CUDA caching allocator's free blocks released between points)."""
    records = []
    for i, point in enumerate(points):
        records += run_point(*point)
        if empty_cache:
            torch.cuda.empty_cache()
        if progress:
            progress(i + 1, len(points), label(*point))
    return records
