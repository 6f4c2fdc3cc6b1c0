"""The guard's decode points measured by whichever attnres is importable (run once per build, same GPU, minutes
apart, to tell a code change from a machine change when the guard flags a regression; tools/ab_commits.sh).

    python3 tools/ab_points.py [REPEATS [T:N,T:N,...]]

Prints one JSON object: per point, add2 at the planned kernel and at forced split_k clusters 7 and 8, and the
eager MoE-tail adds as the reference.

The harness is this file's own (inputs, capture, timing: torch only), never the build's attnres.bench, so that
every build is measured the same way: the benchmark's capture changed at 5f314b2 (every call's output kept alive
during the capture instead of freed and reused), which moved even the eager adds by ~0.1 us and made builds on
either side of it look different. It matches the current benchmark (outputs kept alive, rotating input sets over
twice the L2, interleaved replays, median and p10/p90). Only attnres's public op API, unchanged since the first
benchmark commit 4aed4f9, is called."""

import json
import math
import statistics
import sys

import torch

import attnres

H = 7168
EPS = 1e-5
BF16 = torch.bfloat16


def make_sets(T: int, N: int, count: int, seed: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale + offset).to(BF16)

    return [dict(prefix=rnd(T, H), routed=rnd(T, H, scale=0.5), shared=rnd(T, H, scale=0.5),
                 bank=rnd(N - 1, T, H, scale=2.0), res_weight=rnd(H, scale=0.02),
                 rms_weight=rnd(H, scale=0.1, offset=1.0), norm_weight=rnd(H, scale=0.1, offset=1.0))
            for _ in range(count)]


def add2(s: dict, options):
    return lambda: attnres.attn_res_add_rmsnorm(s["prefix"], s["routed"], s["bank"], s["res_weight"], s["rms_weight"],
                                                s["norm_weight"], EPS, EPS, layer_residual_add2=s["shared"],
                                                options=options)


def eager_adds(s: dict):
    return lambda: s["prefix"] + (s["routed"] + s["shared"])


def capture(calls) -> torch.cuda.CUDAGraph:
    """One warm-up pass on a side stream, then one capture; every call's output stays alive (as a model's
    per-layer outputs do)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [c() for c in calls]
    torch.cuda.synchronize()
    graph.outputs = outputs  # keep them alive with the graph
    return graph


def time_interleaved(graphs: dict, repeats: int, warmup: int = 3) -> dict:
    # Deliberately not attnres.bench.timing's (the same method): that one belongs to the build under test.
    for _ in range(warmup):
        for g, _ in graphs.values():
            g.replay()
    torch.cuda.synchronize()
    samples = {name: [] for name in graphs}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        for name, (g, calls) in graphs.items():
            start.record()
            g.replay()
            stop.record()
            stop.synchronize()
            samples[name].append(start.elapsed_time(stop) * 1000.0 / calls)
    out = {}
    for name, v in samples.items():
        v.sort()
        q = lambda f: v[min(len(v) - 1, max(0, round(f * (len(v) - 1))))]  # noqa: E731
        out[name] = [round(statistics.median(v), 3), round(q(0.1), 3), round(q(0.9), 3)]
    return out


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 25
    # Optional points "T:N,T:N,..." (default the guard's three).
    points = [tuple(int(x) for x in p.split(":")) for p in sys.argv[2].split(",")] if len(sys.argv) > 2 else \
        [(1, 2), (1, 9), (32, 9)]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    out = {"attnres": attnres.__file__, "gpu": torch.cuda.get_device_name(), "harness": "tools/ab_points.py",
           "points": {}}
    for T, N in points:
        step_bytes = (N - 1 + 3 + 2) * T * H * 2 + 3 * H * 2  # as attnres.bench.workloads.step_bytes
        count = int(min(1024, max(8, math.ceil(2 * l2 / step_bytes))))
        sets = make_sets(T, N, count, seed=7 + T * 100 + N)
        graphs = {"auto": (capture([add2(s, attnres.Options()) for s in sets]), count)}
        for c in (7, 8):
            opts = attnres.Options(kernel="split_k", cluster=c)
            graphs[f"c{c}"] = (capture([add2(s, opts) for s in sets]), count)
        graphs["eager_adds"] = (capture([eager_adds(s) for s in sets]), count)
        out["points"][f"T={T} N={N}"] = time_interleaved(graphs, repeats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
