"""The command line of python -m attnres.tp: tensor-parallel (TP) runs of the Kimi K3 decode chain.

    python -m attnres.tp check [--tokens 1,8] [--nproc 2]              spawns the ranks itself
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m attnres.tp check  under torchrun

`check` runs attnres.tp.checks on every rank (NCCL on CUDA when every rank gets a Hopper GPU, else gloo on the
CPU with a small config), prints PASS/FAIL per check (a check passes when it passed on every rank) and exits 1
if any failed. The benchmark is `python -m attnres.bench tp`.

The rank entry points live here, not in __main__, so that spawned ranks can import them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import checks as C
from .launch import init, launch, shutdown, under_torchrun


def _tokens(text: str) -> tuple[int, ...]:
    try:
        tokens = tuple(int(t) for t in text.split(","))
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"--tokens must be comma-separated integers >= 1, got {text!r}")
    return tokens


def _config(opts: dict, device_type: str):
    from attnres.models.kimi_k3 import KimiK3Config, kimi_k3_full_attention_layers

    base = KimiK3Config.real() if device_type == "cuda" else C.cpu_config()
    if opts["hidden"] is None and opts["layers"] is None and opts["block"] is None:
        return base.with_(seed=opts["seed"])
    layers = opts["layers"] or base.num_layers
    hidden = opts["hidden"] or base.hidden_size
    return base.with_(hidden_size=hidden, num_layers=layers, snapshot_block=opts["block"] or base.snapshot_block,
                      full_attention_layers=kimi_k3_full_attention_layers(layers),
                      capture_layers=tuple(c for c in base.capture_layers if c < layers - 1),
                      standin_rank=min(base.standin_rank, hidden), seed=opts["seed"])


def check_rank(opts: dict) -> list[C.Check]:
    """One rank's part of `check`: every rank returns the merged results; rank 0 prints them."""
    import torch

    torch.set_num_threads(opts.get("threads") or torch.get_num_threads())
    ctx = init(opts["device"])
    try:
        t0 = time.perf_counter()
        config = _config(opts, ctx.device.type)
        mine = C.run_checks(ctx, tokens=opts["tokens"], config=config, steps=opts["steps"], seed=opts["seed"],
                            finalize=opts["finalize"], mutation=opts["mutation"])
        merged = C.merge(ctx.all_gather_object(mine))
        if ctx.rank == 0 and opts["verbose"]:
            print(f"attnres.tp check: {ctx.world_size} ranks on {ctx.backend} ({ctx.device.type}), H="
                  f"{config.hidden_size}, {config.num_layers} layers, block {config.snapshot_block}, "
                  f"T={list(opts['tokens'])}, {opts['steps']} steps")
            for c in merged:
                print(c.line())
            failed = sum(not c.passed for c in merged)
            print(f"{len(merged) - failed} checks passed, {failed} failed ({time.perf_counter() - t0:.1f} s)")
            if opts["json"]:
                with open(opts["json"], "w") as f:
                    json.dump([c.__dict__ for c in merged], f, indent=1)
        return merged
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnres.tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="the TP correctness checks on every rank; exit 1 on any failure")
    c.add_argument("--tokens", type=_tokens, default=(1, 8), help="comma-separated T values (default 1,8)")
    c.add_argument("--steps", type=int, default=2, help="decode steps per T (default 2)")
    c.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    c.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun (default 2)")
    c.add_argument("--hidden", type=int, default=None, help="hidden size (default 7168 on cuda, 256 on cpu)")
    c.add_argument("--layers", type=int, default=None, help="decoder layers (default 93 on cuda, 14 on cpu)")
    c.add_argument("--block", type=int, default=None, help="snapshot block (default 12 on cuda, 4 on cpu)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--no-finalize", action="store_true", help="skip the finalize checks")
    c.add_argument("--mutation", choices=C.MUTATIONS, default="none",
                   help="switch on one deliberate fault (the checks must then fail)")
    c.add_argument("--json", default=None, help="also write the merged results here (rank 0)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    opts = dict(tokens=args.tokens, steps=args.steps, device=args.device, hidden=args.hidden, layers=args.layers,
                block=args.block, seed=args.seed, finalize=not args.no_finalize, mutation=args.mutation,
                json=args.json, verbose=True, threads=None)
    if under_torchrun():
        merged = check_rank(opts)
    else:
        if args.nproc < 1:
            p.error("--nproc must be >= 1")
        opts["threads"] = 1 if args.device != "cuda" else None
        merged = launch(check_rank, args.nproc, opts)[0]
    return 0 if all(c.passed for c in merged) else 1

