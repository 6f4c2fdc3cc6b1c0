"""python -m attnres: command-line entry points.

    python -m attnres demo [--help]   the Kimi K3 decode chain with and without the MoE-tail fold: which kernel
                                      ran at each kind of site, the fold-vs-eager bitwise check, step times

Subcommands are registered in _COMMANDS (a benchmark entry point can join `demo` there).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace

import torch

import attnres


# ---------------------------------------------------------------------------------------------- demo
def _pick_device(choice: str) -> str:
    if choice != "auto":
        return choice
    info = attnres.backend_info()
    hopper = any(int(d["cc"].split(".")[0]) >= 9 for d in info["cuda_devices"])
    return "cuda" if info["cuda_backend"] and hopper and torch.cuda.is_available() else "cpu"


def _config(args, device: str):
    from attnres.models.kimi_k3 import KimiK3Config

    custom = args.hidden is not None or args.layers is not None or args.block is not None
    real = args.real or (device == "cuda" and not custom)
    if real:
        overrides = {k: v for k, v in (("hidden_size", args.hidden), ("num_layers", args.layers),
                                       ("snapshot_block", args.block)) if v is not None}
        return KimiK3Config.real(**overrides) if overrides else KimiK3Config.real()
    # On the CPU a smaller stack finishes in seconds; Kimi's block of 12 keeps its N range (up to 4 here).
    layers = args.layers or 37
    return KimiK3Config.small(hidden_size=args.hidden or 1024, num_layers=layers, snapshot_block=args.block or 12,
                              capture_layers=tuple(c for c in (1, 11, 19) if c < layers))


class _Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end)
        t0 = time.perf_counter()
        result = fn()
        return result, (time.perf_counter() - t0) * 1e3


def _paths_table(entries) -> list[str]:
    counts = Counter((e.kind, e.path, e.kernel, e.reason) for e in entries)
    from attnres.models.kimi_k3.residual import SITE_KINDS

    order = {kind: i for i, kind in enumerate(SITE_KINDS)}
    lines = []
    for (kind, path, kernel, reason), n in sorted(counts.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0])):
        what = path + (f" [{kernel}]" if kernel else "") + (f" ({reason})" if reason else "")
        lines.append(f"    {kind:<9} {what:<40} x{n}")
    return lines


def demo(args) -> int:
    from attnres.models.kimi_k3 import ChainTrace, KimiK3Model, ResidualSettings, compare_outputs, compare_traces

    device = _pick_device(args.device)
    if device == "cuda" and _pick_device("auto") != "cuda":
        print("demo: --device cuda needs attnres built with CUDA and a Hopper GPU", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    if device == "cpu":
        torch.set_num_threads(1)  # tiny ops: intra-op threads cost more in spin-waits than they save
    config = _config(args, device).with_(seed=args.seed)
    base = ResidualSettings.from_knobs()
    if args.tokens > base.max_tokens and base.topology == "per_token":
        print(f"note: T = {args.tokens} is above KIMI_K3_FUSED_ATTN_RES_MAX_TOKENS = {base.max_tokens}: the sites "
              "run eager and the fold does not apply")
    folds = {"on": [True], "off": [False], "both": [False, True]}[args.fold]

    info = attnres.backend_info()
    where = "CPU reference backend" if device == "cpu" else info["cuda_devices"][0]["name"]
    print(f"attnres {attnres.__version__} demo: Kimi K3 decode chain, stand-in attention and MoE")
    print(f"  device {device} ({where}); H = {config.hidden_size}, {config.num_layers} layers, snapshot block "
          f"{config.snapshot_block} ({config.num_snapshots} snapshots, N <= {config.output_candidates}), "
          f"T = {args.tokens}, {args.steps} steps, taps of layers {list(config.capture_layers)}")
    print(f"  knobs (read at import): fold={int(base.fold)} fused={int(base.fused)} max_tokens={base.max_tokens} "
          f"topology={base.topology} aux_stream={int(base.aux_stream)}")

    t0 = time.perf_counter()
    model = KimiK3Model(config, settings=base, device=device)
    print(f"  built the model in {time.perf_counter() - t0:.2f} s")
    timer = _Timer(device)
    inputs = [model.embed(args.tokens, step=s) for s in range(args.steps)]
    runs = {}
    for fold in folds:
        model.settings = replace(base, fold=fold)
        model(model.embed(args.tokens, step=10**6))  # warm-up (first-call setup, allocator, plan cache)
        # One traced step (untimed) for the paths and the bitwise check. The trace compares whole banks, rows
        # not yet written included, so both chains get a bank with the same contents (not torch.empty).
        model.paths.clear()
        trace = ChainTrace()
        model(inputs[0], bank=model.allocate_bank(args.tokens, fill=0.0), trace=trace)
        step_paths = list(model.paths.entries)
        model.paths.keep = False  # timed steps: decisions are still made, not kept
        outs, times = [], []
        for x in inputs:
            out, ms = timer(functools.partial(model, x))
            outs.append(out)
            times.append(ms)
        model.paths.keep = True
        runs[fold] = (outs, times, trace, step_paths)

    for fold in folds:
        print(f"\nfold {'on ' if fold else 'off'}: paths of one step, per site kind [kernel] (reason)")
        print("\n".join(_paths_table(runs[fold][3])))
    N = config.output_candidates
    plan = attnres.plan("attn_res_add_rmsnorm", tokens=args.tokens, candidates=N, hidden=config.hidden_size,
                        device=device, add=True, add2=True, options=base.options)
    print(f"\n  attnres.plan(attn_res_add_rmsnorm, add2, T={args.tokens}, N={N}, H={config.hidden_size}): "
          + (f"declined: {plan.decline}" if not plan.accepted else f"kernel {plan.kernel}"
             + (f", cluster {plan.cluster}, {plan.threads} threads, pdl {plan.pdl}" if device == "cuda" else "")))

    status = 0
    if len(folds) == 2:
        (outs_e, _, tr_e, _), (outs_f, _, tr_f, _) = runs[False], runs[True]
        diffs = compare_traces(tr_e, tr_f)
        for a, b in zip(outs_e, outs_f, strict=True):
            diffs += compare_outputs(a, b)
        n_taps = sum(len(o.taps) for o in outs_f)
        if diffs:
            status = 1
            print(f"\nbitwise fold vs eager: DIFFERENT ({len(diffs)} differences)")
            print("\n".join("    " + d for d in diffs[:10]))
        else:
            print(f"\nbitwise fold vs eager: identical — {len(tr_f.sites)} site prefixes/outputs and "
                  f"{len(tr_f.banks)} bank states (step 0), {args.steps} model outputs, {n_taps} taps")

    what = "CUDA events" if device == "cuda" else "wall clock"
    print(f"\nstep time ({what}, median of {args.steps}; eager PyTorch with Python dispatch per op — Python overhead "
          "dominates, the fold saves kernel launches that CUDA graphs would expose):")
    for fold in folds:
        times = runs[fold][1]
        print(f"    fold {'on ' if fold else 'off'}: {statistics.median(times):8.2f} ms  "
              f"(min {min(times):.2f}, max {max(times):.2f})")
    return status


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="run the Kimi K3 decode chain with and without the MoE-tail fold",
                       description="Runs the Kimi K3 decode chain (stand-in sub-layers) for a few steps with and "
                                   "without the MoE-tail fold; prints the paths per site kind, the fold-vs-eager "
                                   "bitwise comparison and the step times. Settings other than the fold come from "
                                   "the KIMI_K3_* knobs (docs/knobs.md).")
    p.add_argument("--hidden", type=int, default=None, help="hidden size H (default: 7168 with --real or on CUDA, "
                                                            "1024 on the CPU)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: 93 real, 37 on the CPU)")
    p.add_argument("--block", type=int, default=None, help="snapshot block (default 12)")
    p.add_argument("--steps", type=int, default=3, help="decode steps per variant (default 3)")
    p.add_argument("--tokens", type=int, default=4, help="tokens per step, T (default 4)")
    p.add_argument("--fold", choices=("on", "off", "both"), default="both", help="which chains to run")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when attnres has the CUDA backend and a Hopper GPU, else cpu")
    p.add_argument("--real", action="store_true", help="Kimi K3's real config (93 layers, H = 7168); the default "
                                                       "on CUDA")
    p.add_argument("--seed", type=int, default=0, help="weight and input seed")
    p.set_defaults(func=demo)


_COMMANDS = (_add_demo,)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        if os.path.basename(sys.argv[0]).startswith("attnres-demo"):
            argv = ["demo", *argv]  # the attnres-demo console script
    parser = argparse.ArgumentParser(prog="python -m attnres", description="attnres command-line tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    if getattr(args, "steps", 1) < 1 or getattr(args, "tokens", 1) < 1:
        parser.error("--steps and --tokens must be >= 1")
    try:
        return args.func(args)
    except (ValueError, attnres.AttnResError) as e:
        print(f"{args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
