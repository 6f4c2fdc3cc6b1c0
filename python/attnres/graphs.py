"""CUDA-graph capture as the tests, the stress runner and the benchmarks do it: one warm-up call on a side
stream (lazy initialisation, autotuning and allocator growth stay out of the graph), then one capture."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

R = TypeVar("R")


def capture(fn: Callable[[], R], capture_error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, R]:
    """Runs fn once eagerly on a side stream, then captures it; returns the graph and what the captured call
    returned (the tensors a replay overwrites). capture_error_mode as torch.cuda.graph's ("thread_local" when
    another thread, such as NCCL's watchdog, queries events during the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        out = fn()
    torch.cuda.synchronize()
    return graph, out
