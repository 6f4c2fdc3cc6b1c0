"""The command line of python -m stress: argument checks, the JSON summary on stdout, the exit code."""

from __future__ import annotations

import argparse
import json
import sys

from .calls import run_calls
from .chain import run_chain


def parser() -> argparse.ArgumentParser:
    import stress as package  # its docstring, once the package has finished importing
    p = argparse.ArgumentParser(prog="python -m stress", description=package.__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    c = sub.add_parser("calls", help="randomly shaped calls checked against the CPU backend",
                       description="Randomly shaped calls of every op (on CUDA: several streams and CUDA-graph "
                                   "replays), each checked against the CPU backend and, where asked, the float64 "
                                   "oracle. Prints a JSON summary; exit 1 on any mismatch.")
    c.add_argument("--count", type=int, default=1000, help="calls to make (default 1000)")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="where the calls run (default cuda)")
    c.add_argument("--streams", type=int, default=4, help="CUDA streams, used round-robin")
    c.add_argument("--graph-every", type=int, default=100, help="capture + replay every n-th call (0: never)")
    c.add_argument("--batch", type=int, default=64, help="calls in flight between synchronisations")
    c.add_argument("--workers", type=int, default=0, help="CPU check threads (0: cores, minus one on CUDA)")
    c.add_argument("--max-tokens", type=int, default=256, help="largest T of the rare large calls")
    c.add_argument("--oracle-every", type=int, default=-1,
                   help="also check every n-th call against the float64 oracle (-1: every call on cpu, none on cuda)")
    c.add_argument("--seed", type=int, default=0, help="seed of the call draws (default 0)")
    c.add_argument("--start", type=int, default=0, help="first call index (to rerun one failing call: --count 1)")
    c.add_argument("--max-seconds", type=float, default=None, help="stop issuing calls after this long")
    c.add_argument("--quiet", action="store_true", help="no progress lines, only the JSON summary")
    h = sub.add_parser("chain", help="the Kimi K3 decode chain, fold on vs off, bit for bit",
                       description="Steps the Kimi K3 decode chain with the MoE-tail fold on and off (on CUDA as "
                                   "CUDA-graph replays) and compares the two bit for bit every --check-every steps. "
                                   "Prints a JSON summary; exit 1 on any difference.")
    h.add_argument("--steps", type=int, default=100, help="decode steps (default 100)")
    h.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="where the chain runs (default cuda)")
    h.add_argument("--tokens", type=int, default=1, help="tokens per step, T (default 1)")
    h.add_argument("--layers", type=int, default=None, help="decoder layers (default: 93 on cuda, 26 on cpu)")
    h.add_argument("--hidden", type=int, default=None, help="hidden size (default: 7168 on cuda, 256 on cpu)")
    h.add_argument("--block", type=int, default=None, help="snapshot block (default 12 on cuda, 4 on cpu)")
    h.add_argument("--check-every", type=int, default=100, help="compare the two chains every n steps (default 100)")
    h.add_argument("--eager", action="store_true", help="no CUDA graphs")
    h.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    h.add_argument("--max-seconds", type=float, default=None, help="stop stepping after this long")
    h.add_argument("--quiet", action="store_true", help="no progress lines, only the JSON summary")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.mode == "calls":
            if args.count < 1 or args.streams < 1 or args.batch < 1 or args.max_tokens < 1:
                raise ValueError("calls: --count, --streams, --batch and --max-tokens must be >= 1")
            summary = run_calls(args.count, device=args.device, streams=args.streams, seed=args.seed,
                                start=args.start, graph_every=args.graph_every, batch=args.batch,
                                workers=args.workers or None, max_tokens=args.max_tokens,
                                oracle_every=None if args.oracle_every < 0 else args.oracle_every,
                                max_seconds=args.max_seconds, quiet=args.quiet)
        else:
            summary = run_chain(args.steps, device=args.device, tokens=args.tokens, layers=args.layers,
                                hidden=args.hidden, block=args.block, check_every=args.check_every,
                                eager=args.eager, seed=args.seed, max_seconds=args.max_seconds, quiet=args.quiet)
    except (ValueError, RuntimeError) as err:
        print(f"stress: {err}", file=sys.stderr)
        return 2
    for f in summary.get("failures", [])[:5]:
        print(f"FAILED {f['kind']} call {f['call']}: {f['detail']}\n  spec {json.dumps(f['spec'])}", file=sys.stderr)
    print(json.dumps(summary, sort_keys=True))
    return 0 if summary["ok"] else 1
