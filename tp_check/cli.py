"""The command line of python -m tp_check: tensor-parallel (TP) runs of the Kimi K3 decode chain.

    python -m tp_check check [--tokens 1,8] [--nproc 2]              spawns the ranks itself
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m tp_check check  under torchrun
    python -m tp_check check --one-gpu --nproc 4 --tokens 1 --steps 1 every rank a process on cuda:0

`check` runs tp_check.checks on every rank (NCCL on CUDA when every rank gets a Hopper GPU, else gloo on the
CPU with a small config), prints PASS/FAIL per check (a check passes when it passed on every rank) and exits 1
if any failed. With --one-gpu the W ranks are W processes on cuda:0 joined by gloo (NCCL refuses two ranks on
one device; gloo moves CUDA tensors through the host) and the one-shot ops map each other's buffers through CUDA
IPC: the same checks with the real kernels on a one-GPU machine. The processes' kernels time-slice, so a
one-shot op's spin wait progresses only at context switches: keep T small and the steps few. The benchmark is
`python -m bench tp`.
"""
# The rank entry points live here, not in __main__, so that spawned ranks can import them.

from __future__ import annotations

import argparse
import json
import os
import time

from attnres.__main__ import _tokens  # the demo's --tokens: comma-separated T values >= 1

from . import checks as C
from .launch import init, launch, resolve_one_gpu_device, shutdown, under_torchrun


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
    return check_rank_variants(opts, [{}])[0]


def check_rank_variants(opts: dict, variants: list[dict]) -> list[list[C.Check]]:
    """Joins the group once, then runs the checks once per variant (opts updated by it): the merged results
    of each, on every rank. Rank 0 prints them when opts["verbose"]."""
    import torch

    if opts.get("threads"):
        torch.set_num_threads(opts["threads"])
    ctx = init(opts["device"], one_gpu=opts.get("one_gpu", False))
    try:
        results = []
        for variant in variants:
            o = {**opts, **variant}
            t0 = time.perf_counter()
            config = _config(o, ctx.device.type)
            mine = C.run_checks(ctx, tokens=o["tokens"], config=config, steps=o["steps"], seed=o["seed"],
                                finalize=o["finalize"], mutation=o["mutation"])
            merged = C.merge(ctx.all_gather_object(mine))
            if ctx.rank == 0 and o["verbose"]:
                _report(ctx, config, o, merged, time.perf_counter() - t0)
            results.append(merged)
        return results
    finally:
        shutdown()


def _report(ctx, config, o: dict, merged: list[C.Check], seconds: float) -> None:
    where = "every rank on cuda:0" if ctx.one_gpu else ctx.device.type
    print(f"tp_check check: {ctx.world_size} ranks on {ctx.backend} ({where}), H={config.hidden_size}, "
          f"{config.num_layers} layers, block {config.snapshot_block}, T={list(o['tokens'])}, {o['steps']} steps"
          + (f", mutation {o['mutation']}" if o["mutation"] != "none" else ""))
    for c in merged:
        print(c.line())
    failed = sum(not c.passed for c in merged)
    print(f"{len(merged) - failed} checks passed, {failed} failed ({seconds:.1f} s)", flush=True)
    if o.get("json"):
        with open(o["json"], "w") as f:
            json.dump([c.__dict__ for c in merged], f, indent=1)


def default_opts(**overrides) -> dict:
    """The options of `check` as the command line's defaults (for callers such as the tests)."""
    opts = dict(tokens=(1, 8), steps=2, device="auto", hidden=None, layers=None, block=None, seed=0, finalize=True,
                mutation="none", json=None, verbose=False, threads=None, one_gpu=False)
    unknown = set(overrides) - set(opts)
    if unknown:
        raise ValueError(f"default_opts: unknown options {sorted(unknown)}")
    return {**opts, **overrides}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tp_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("check", help="the TP correctness checks on every rank; exit 1 on any failure",
                       description="Runs the TP correctness checks of the decode chain on every rank and prints "
                                   "PASS/FAIL per check; exit 1 if any failed.")
    c.add_argument("--tokens", type=_tokens, default=(1, 8), help="comma-separated T values (default 1,8)")
    c.add_argument("--steps", type=int, default=2, help="decode steps per T (default 2)")
    c.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto (default): NCCL on CUDA when every rank gets a Hopper GPU, else gloo on the CPU")
    c.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun (default 2)")
    c.add_argument("--one-gpu", action="store_true",
                   help="every rank a process on cuda:0, joined by gloo; the one-shot ops through CUDA IPC "
                        "(needs --device cuda or auto and a Hopper GPU)")
    c.add_argument("--hidden", type=int, default=None, help="hidden size (default 7168 on cuda, 256 on cpu)")
    c.add_argument("--layers", type=int, default=None, help="decoder layers (default 93 on cuda, 14 on cpu)")
    c.add_argument("--block", type=int, default=None, help="snapshot block (default 12 on cuda, 4 on cpu)")
    c.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    c.add_argument("--no-finalize", action="store_true", help="skip the finalize checks")
    c.add_argument("--mutation", choices=C.MUTATIONS, default="none",
                   help="switch on one deliberate fault (the checks must then fail)")
    c.add_argument("--json", default=None, help="also write the merged results here (rank 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    device = args.device
    if args.one_gpu:
        # Refused here, before any rank is spawned: a rank that fails in init would leave the others waiting.
        try:
            device = resolve_one_gpu_device(args.device)
        except (ValueError, RuntimeError) as e:
            p.error(f"--one-gpu: {e}")
    opts = default_opts(tokens=args.tokens, steps=args.steps, device=device, hidden=args.hidden,
                        layers=args.layers, block=args.block, seed=args.seed, finalize=not args.no_finalize,
                        mutation=args.mutation, json=args.json, verbose=True, one_gpu=args.one_gpu)
    if under_torchrun():
        merged = check_rank(opts)
    else:
        if args.nproc < 1:
            p.error("--nproc must be >= 1")
        if args.one_gpu:
            # W processes share the host's cores for gloo's host staging and the checks' float64 audits.
            opts["threads"] = max(1, (os.cpu_count() or 1) // args.nproc)
        else:
            opts["threads"] = 1 if device != "cuda" else None
        merged = launch(check_rank, args.nproc, opts)[0]
    return 0 if all(c.passed for c in merged) else 1

