"""python -m attnres.bench: the GPU benchmark suites. Results go to a JSON file keyed by GPU and commit."""

from __future__ import annotations

import argparse
import sys

import torch

import attnres

from . import decode, finalize, floors, results, tune


def _progress_printer():
    try:
        from rich.progress import Progress
    except ImportError:  # rich is optional: plain lines
        return None, lambda i, n, what: print(f"[{i}/{n}] {what}", flush=True)
    prog = Progress(transient=False)
    task = {}

    def update(i, n, what):
        if "id" not in task:
            task["id"] = prog.add_task(what, total=n)
        prog.update(task["id"], completed=i, description=what)

    return prog, update


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnres.bench", description=__doc__)
    p.add_argument("suite", choices=["decode", "tune", "finalize", "floors", "all", "plot"],
                   help="which sweep to run; 'plot' draws the PNGs of an existing results file (--out) into --plots")
    p.add_argument("--quick", action="store_true", help="a reduced grid (about a minute)")
    p.add_argument("--out", default="bench_results.json", help="results file (JSON)")
    p.add_argument("--commit", default=None, help="commit the numbers belong to (default: git HEAD)")
    p.add_argument("--no-pdl", action="store_true", help="decode suite without programmatic dependent launch")
    p.add_argument("--repeats", type=int, default=25, help="timed replays per variant (interleaved)")
    p.add_argument("--plots", default="docs/perf", help="plot: where the PNGs go")
    args = p.parse_args(argv)
    if args.suite == "plot":
        from .plots import make_plots

        for path in make_plots(args.out, args.plots):
            print(path)
        return 0
    if not torch.cuda.is_available():
        print("attnres.bench needs a CUDA GPU", file=sys.stderr)
        return 2

    meta = results.metadata(args.commit)
    extra = {}
    records: list[dict] = []
    prog, progress = _progress_printer()
    if prog:
        prog.start()
    try:
        if args.suite in ("floors", "all"):
            extra["floors"] = {"copy_tbs": floors.copy_bandwidth_tbs(), "launch": floors.launch_floor_us()}
        if args.suite in ("decode", "all"):
            records += decode.run(quick=args.quick, options=attnres.Options(pdl=not args.no_pdl), progress=progress,
                                  repeats=args.repeats)
        if args.suite in ("tune", "all"):
            records += tune.run(quick=args.quick, progress=progress)
        if args.suite in ("finalize", "all"):
            records += finalize.run(quick=args.quick, progress=progress, repeats=args.repeats)
    finally:
        if prog:
            prog.stop()
    results.save(args.out, meta, records, extra)
    print(f"\n{meta['gpu']} commit {meta['commit']}: {len(records)} records -> {args.out}")
    if "floors" in extra:
        print(f"floors: copy {extra['floors']['copy_tbs']:.2f} TB/s, launch {extra['floors']['launch']['median_us']:.2f} us/node")
    for row in results.targets(records):
        print(f"{row[0]}: {row[1]}: {row[2]} -> {'met' if row[3] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
