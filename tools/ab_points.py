"""The guard's decode points measured by whichever attnres is importable (run once per build, same GPU, minutes
apart, to tell a code change from a machine change when the guard flags a regression; tools/ab_commits.sh).

Prints one JSON object: per point, add2 at the planned kernel and at forced split_k clusters 7 and 8, and the
eager MoE-tail adds as the reference. Only APIs present since the first benchmark commit (4aed4f9) are used."""

import json
import sys

import torch

import attnres
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import attnres_call, eager_tail_adds, make_sets, step_bytes

H = 7168
out = {"attnres": attnres.__file__, "gpu": torch.cuda.get_device_name(), "points": {}}
for T, N in ((1, 2), (1, 9), (32, 9)):
    sets = make_sets(T, N, H, rotating_sets(step_bytes(T, N, H)), seed=7 + T * 100 + N)
    graphs = {"auto": (capture([attnres_call(s, "add2", attnres.Options()) for s in sets]), len(sets))}
    for c in (7, 8):
        opts = attnres.Options(kernel="split_k", cluster=c)
        graphs[f"c{c}"] = (capture([attnres_call(s, "add2", opts) for s in sets]), len(sets))
    graphs["eager_adds"] = (capture([eager_tail_adds(s) for s in sets]), len(sets))
    t = time_interleaved(graphs, repeats=int(sys.argv[1]) if len(sys.argv) > 1 else 25)
    out["points"][f"T={T} N={N}"] = {k: [round(v.median_us, 3), round(v.p10_us, 3), round(v.p90_us, 3)]
                                     for k, v in t.items()}
print(json.dumps(out))
