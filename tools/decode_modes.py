"""Are the decode sweep's two levels at small N (3.3 vs 3.7 us for one kernel instance, docs/performance.md) a
property of the point or of the capture? On the GPU, from the repository root, after the CUDA build:

    python3 tools/decode_modes.py [TRIALS] [--no-pdl] [--shift] [--out FILE]

For T = 1, H = 7168 and N in {2, 3, 4, 9}, each trial makes fresh input sets (a new seed, so new allocations) and
captures fresh graphs of noadd / add / add2 (one call per rotating set, as the decode suite), then times them
interleaved; trial 0 and the last trial use the same seed. If a point's level follows the trial (the same N and
variant at 3.3 in one trial and 3.7 in another), the level belongs to the capture (placement, addresses), not to
the kernel instance or N. Prints one line per (N, variant) with the per-trial medians and writes them as JSON.

The caching allocator hands the same addresses to the same allocation sequence, so fresh seeds alone do not move
the data. --shift holds a small allocation of a different size during each trial but the last (the allocator's
512-byte granularity), which moves the trial's input sets to other addresses (the graphs' outputs live in each
graph's own pool and may not move): levels that then follow the trial are an address effect (L2 slices, DRAM
channels).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import attnres
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import attnres_call, eager_tail_adds, make_sets, step_bytes

H = 7168
POINTS = (2, 3, 4, 9)
VARIANTS = ("noadd", "add", "add2")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trials", type=int, nargs="?", default=4)
    ap.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    ap.add_argument("--shift", action="store_true", help="move the trial's allocations (see above)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_modes: needs a CUDA GPU", file=sys.stderr)
        return 2
    options = attnres.Options(pdl=not args.no_pdl)
    seeds = [1000 * t + 7 for t in range(args.trials - 1)] + [7]  # the last trial repeats the first seed
    shifts = [(512 * (1 + 37 * t) if args.shift and t < len(seeds) - 1 else 0) for t in range(len(seeds))]
    table: dict[str, list[float]] = {}
    for trial, seed in enumerate(seeds):
        spacer = torch.empty(shifts[trial], dtype=torch.uint8, device="cuda") if shifts[trial] else None
        for N in POINTS:
            sets = make_sets(1, N, H, rotating_sets(step_bytes(1, N, H)), seed=seed + N)
            graphs = {v: (capture([attnres_call(s, v, options) for s in sets]), len(sets)) for v in VARIANTS}
            graphs["eager_tail_adds"] = (capture([eager_tail_adds(s) for s in sets]), len(sets))
            for name, t in time_interleaved(graphs, repeats=15).items():
                table.setdefault(f"N={N} {name}", []).append(round(t.median_us, 3))
            del graphs, sets
            torch.cuda.empty_cache()
        del spacer
    for key, values in table.items():
        print(f"{key:24s} " + " ".join(f"{v:6.2f}" for v in values))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "pdl": options.pdl, "seeds": seeds,
                       "shift_bytes": shifts, "per_trial_median_us": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
