"""python -m attnres: the command-line entry points.

    python -m attnres demo     the Kimi K3 decode step with the MoE-tail fold off and on (attnres.demo)
    python -m attnres bench    the GPU benchmark suites (= python -m attnres.bench)

`python -m attnres COMMAND --help` shows each command's options.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import attnres

# command -> (module whose main(argv) runs it, one line of help). demo is parsed here; the others own their
# command lines and get the remaining arguments as they are.
FORWARDED = {
    "bench": ("attnres.bench.cli", "GPU benchmark suites (decode sweep, MoE finalize, decode chain, host cost of a "
                                   "call); results to a JSON file"),
}
DEMO_HELP = "the Kimi K3 decode step with the MoE-tail fold off and on: paths, bitwise check, step times"


def _tokens(text: str) -> tuple[int, ...]:
    try:
        tokens = tuple(int(t) for t in text.split(","))
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {text!r}")
    return tokens


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _add_demo(sub) -> None:
    from attnres.demo import main as demo

    p = sub.add_parser("demo", help=DEMO_HELP,
                       description="Times one Kimi K3 decode step with the MoE-tail fold off and on, as the decode-"
                                   "chain benchmark does: on a Hopper GPU each step is one CUDA graph and the two "
                                   "are replayed interleaved; on the CPU the step runs eagerly and its timings are "
                                   "shown with their spread (they are not a measurement of the fold). Also prints "
                                   "the path and kernel of every kind of site and checks that the two chains agree "
                                   "bit for bit. Takes about 5 s on a 2-core CPU.")
    p.add_argument("--tokens", type=_tokens, default=None,
                   help="comma-separated T values, tokens per step (default: 1,8 on CUDA, 4 on the CPU)")
    p.add_argument("--repeats", type=_positive, default=25, help="timed steps per variant, interleaved (default 25)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): cuda when attnres has the CUDA backend and a Hopper GPU, else cpu")
    p.add_argument("--real", action="store_true",
                   help="Kimi K3's real config (93 layers, H = 7168) also on the CPU; the default on CUDA")
    p.add_argument("--hidden", type=int, default=None,
                   help=f"hidden size H, a multiple of {attnres._C.limits['hidden_multiple']} in "
                        f"[{attnres._C.limits['hidden_multiple']}, {attnres._C.limits['max_hidden']}] (default: 7168 on "
                        "CUDA, 256 on the CPU)")
    p.add_argument("--layers", type=_positive, default=None, help="decoder layers (default: 93 on CUDA, 26 on the CPU)")
    p.add_argument("--block", type=_positive, default=None,
                   help="layers per snapshot block (default: 12 on CUDA, 4 on the CPU)")
    p.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch (CUDA)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="also draw the step times and the saving per MoE layer into FILE (PNG; needs matplotlib)")
    p.set_defaults(func=demo)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnres", description="attnres command-line tools",
                                epilog="`python -m attnres COMMAND --help` shows each command's options.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(sub)
    for name, (_, line) in FORWARDED.items():
        sub.add_parser(name, help=line, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        if os.path.basename(sys.argv[0]).startswith("attnres-demo"):
            argv = ["demo", *argv]  # the attnres-demo console script
    if argv and argv[0] in FORWARDED:
        return importlib.import_module(FORWARDED[argv[0]][0]).main(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, attnres.AttnResError) as e:
        print(f"{args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
