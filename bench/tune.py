"""Kernel-geometry sweep that sets the plan's defaults: single_cta vs split_k and the split_k cluster size,
by N and T, at the fast-path hidden sizes; and PDL on vs off. Every configuration of one point is timed
interleaved in the same run (the add2 variant: what the fold runs)."""

from __future__ import annotations

import attnres
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import attnres_call, make_sets, step_bytes


def configs(H: int, N: int) -> dict[str, attnres.Options]:
    out = {}
    if H <= 8192 and N <= 4:
        out["single_cta"] = attnres.Options(kernel="single_cta")
    for c in (2, 3, 4, 7, 8):
        if H // 8 // c >= 8 and (H // 8 + c - 1) // c <= 256:
            out[f"split_k/c{c}"] = attnres.Options(kernel="split_k", cluster=c)
    return out


def run(quick: bool = False, progress=None, repeats: int = 15) -> list[dict]:
    grid = []
    Ns = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16) if not quick else (2, 5, 9)
    for H in (7168,) if quick else (7168, 2304, 4096, 8192):
        for T in ((1, 8, 32) if H == 7168 else (1, 32)):
            for N in (Ns if H == 7168 else (2, 5, 9)):
                grid.append((H, T, N))
    records = []
    for i, (H, T, N) in enumerate(grid):
        sets = make_sets(T, N, H, rotating_sets(step_bytes(T, N, H)), seed=7 + T * 100 + N)
        graphs = {}
        for name, opt in configs(H, N).items():
            graphs[name] = (capture([attnres_call(s, "add2", opt) for s in sets]), len(sets))
        if (H, T, N) in ((7168, 1, 9), (7168, 1, 2), (7168, 32, 9)):
            auto_nopdl = attnres.Options(pdl=False)
            graphs["auto/pdl_off"] = (capture([attnres_call(s, "add2", auto_nopdl) for s in sets]), len(sets))
            graphs["auto/pdl_on"] = (capture([attnres_call(s, "add2", attnres.Options()) for s in sets]), len(sets))
        for name, t in time_interleaved(graphs, repeats=repeats).items():
            records.append({"suite": "tune", "provider": name, "T": T, "N": N, "H": H, "sets": len(sets),
                            "bytes": step_bytes(T, N, H), **t.as_dict()})
        if progress:
            progress(i + 1, len(grid), f"tune H={H} T={T} N={N}")
    return records
