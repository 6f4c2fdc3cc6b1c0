"""The decode-size sweep of attn_res_add_rmsnorm (the decode-kernels issue): T = 1 with N = 1..12, and
T in {1, 2, 4, 8, 16, 32} at N = 9, each for no add / add / add2, against the two eager MoE-tail adds and the
PyTorch step (eager and torch.compile), all interleaved per point in one run."""

from __future__ import annotations

import attnres

from .timing import capture, rotating_sets, time_interleaved
from .workloads import attnres_call, eager_tail_adds, make_sets, step_bytes, torch_step_call

H_DEFAULT = 7168
COMPILE_POINTS = {(1, 2), (1, 5), (1, 9), (1, 12), (8, 2), (8, 5), (8, 9), (32, 2), (32, 5), (32, 9)}


def points(quick: bool = False) -> list[tuple[int, int]]:
    if quick:
        return [(1, 2), (1, 5), (1, 9), (8, 9), (32, 9)]
    pts = [(1, n) for n in range(1, 13)] + [(t, 9) for t in (2, 4, 8, 16, 32)]
    return pts


def run_point(T: int, N: int, H: int, options: attnres.Options, baselines: bool, compile_baseline: bool,
              repeats: int) -> list[dict]:
    sets = make_sets(T, N, H, rotating_sets(step_bytes(T, N, H)), seed=T * 100 + N)
    graphs = {}
    for variant in ("noadd", "add", "add2"):
        graphs[f"attnres/{variant}"] = (capture([attnres_call(s, variant, options) for s in sets]), len(sets))
    if baselines:
        graphs["eager_tail_adds"] = (capture([eager_tail_adds(s) for s in sets]), len(sets))
        graphs["torch_eager_step"] = (capture([torch_step_call(s, compiled=False) for s in sets]), len(sets))
        if compile_baseline:
            graphs["torch_compile_step"] = (capture([torch_step_call(s, compiled=True) for s in sets]), len(sets))
    timings = time_interleaved(graphs, repeats=repeats)
    plan = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=N, hidden=H, device="cuda", add=True,
                        add2=True, options=options)
    records = []
    for name, t in timings.items():
        records.append({"suite": "decode", "provider": name, "T": T, "N": N, "H": H, "sets": len(sets),
                        "kernel": plan.kernel if name.startswith("attnres") else None,
                        "cluster": plan.cluster if name.startswith("attnres") else None,
                        "pdl": options.pdl, "bytes": step_bytes(T, N, H), **t.as_dict()})
    return records


def run(quick: bool = False, H: int = H_DEFAULT, options: attnres.Options | None = None, progress=None,
        repeats: int = 25) -> list[dict]:
    options = options or attnres.Options()
    records = []
    pts = points(quick)
    for i, (T, N) in enumerate(pts):
        records += run_point(T, N, H, options, baselines=True, compile_baseline=(T, N) in COMPILE_POINTS,
                             repeats=repeats)
        if progress:
            progress(i + 1, len(pts), f"decode T={T} N={N}")
    return records
