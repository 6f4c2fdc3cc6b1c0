"""python -m attnres.bench: how fast attnres runs on this GPU. Results go to a JSON file keyed by GPU and commit.

The options and the measuring loop shared with the repository's own suites (`python -m bench` in a checkout)
live here too: add_common_arguments, chain_tokens/chain_config, SUITE_STEPS and measure."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

import attnres

from . import chain, decode, finalize, host, results

SUITES = {
    "decode": "the ops against torch eager and torch.compile of the same step, T = 1..32, N = 2..16, H = 7168",
    "finalize": "the fused MoE finalize against the unfused PyTorch sequence, k = 16, D = 3584",
    "chain": "the 93-layer Kimi K3 decode step, MoE-tail fold on vs off, one CUDA graph per step",
    "host": "the host cost of one eager call (T = 1, N = 9, H = 7168), issued back to back, against an eager "
            "add + rms_norm and torch.empty_like in the same run (--device cpu: on the CPU backend)",
}
CPU_SUITES = ("chain", "host")  # the suites --device cpu applies to

# One step of a GPU run: (progress, extra) -> records; `extra` holds what the run adds to the results file beside
# the records (floors, interrupted).
Step = Callable[[Callable, dict], list]


def _progress_printer():
    try:
        from rich.progress import Progress
    except ImportError:  # rich is optional: plain lines
        return None, print_progress
    prog = Progress(transient=False)
    task = {}

    def update(i, n, what):
        if "id" not in task:
            task["id"] = prog.add_task(what, total=n)
        prog.update(task["id"], completed=i, description=what)

    return prog, update


def print_progress(i: int, n: int, what: str) -> None:
    print(f"[{i}/{n}] {what}", flush=True)


def new_parser(prog: str, description: str, suites: dict[str, str]) -> argparse.ArgumentParser:
    """A parser whose positional SUITE is one of `suites` (listed in the epilog)."""
    listing = "\n".join(f"  {name:<11} {line}" for name, line in suites.items())
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"suites:\n{listing}\n\nMethod and current figures: docs/performance.md.")
    p.add_argument("suite", choices=list(suites), metavar="SUITE", help="which suite to run (listed below)")
    return p


# The help of the options whose meaning depends on the suites a command line offers (add_common_arguments).
HELP = {
    "out": "results file (JSON; default bench_results.json)",
    "no_pdl": "decode and chain without programmatic dependent launch",
    "device": "cpu: the chain on the CPU backend with a small config, timed eagerly by wall clock (no graphs): "
              "exercises the code, measures nothing",
    "tokens": "comma-separated T values (default 1,4,8,32; --quick: 1,32)",
    "hidden": "hidden size (chain: default 7168 on cuda, 256 on cpu)",
    "layers": "decoder layers (default 93 on cuda, 26 on cpu)",
}


def add_common_arguments(p: argparse.ArgumentParser, helps: dict[str, str] | None = None) -> None:
    """The options every suite shares; `helps` replaces entries of HELP (another command line's suites)."""
    helps = {**HELP, **(helps or {})}
    p.add_argument("--quick", action="store_true", help="a reduced grid of the chosen suite")
    p.add_argument("--out", default=None, help=helps["out"])
    p.add_argument("--commit", default=None, help="commit the numbers belong to (default: git HEAD)")
    p.add_argument("--no-pdl", action="store_true", help=helps["no_pdl"])
    p.add_argument("--repeats", type=int, default=25, help="timed replays per variant, interleaved (default 25)")
    c = p.add_argument_group("chain")
    c.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=helps["device"])
    c.add_argument("--tokens", default=None, help=helps["tokens"])
    c.add_argument("--hidden", type=int, default=None, help=helps["hidden"])
    c.add_argument("--layers", type=int, default=None, help=helps["layers"])
    c.add_argument("--block", type=int, default=None, help="snapshot block (default 12 on cuda, 4 on cpu)")


def parser() -> argparse.ArgumentParser:
    p = new_parser("python -m attnres.bench", __doc__.split("\n\n")[0], SUITES)
    add_common_arguments(p)
    return p


def check_device(p: argparse.ArgumentParser, args, suites: tuple[str, ...]) -> None:
    if args.device == "cpu" and args.suite not in suites:
        p.error(f"--device cpu applies to the {', '.join(suites[:-1])} and {suites[-1]} suites only")


def chain_tokens(args) -> tuple[int, ...]:
    if args.tokens is None:
        return chain.QUICK_TOKENS if args.quick else chain.TOKENS
    try:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        raise SystemExit(f"--tokens must be comma-separated integers >= 1, got {args.tokens!r}")
    return tokens


def chain_config(args, device: str):
    """Kimi K3's real config on cuda, chain.cpu_config() on cpu; --hidden/--layers/--block override it (with
    the MLA layers and taps of the new depth)."""
    from attnres.models.kimi_k3 import KimiK3Config, kimi_k3_full_attention_layers

    base = KimiK3Config.real() if device == "cuda" else chain.cpu_config()
    if args.hidden is None and args.layers is None and args.block is None:
        return base
    layers = args.layers or base.num_layers
    return base.with_(hidden_size=args.hidden or base.hidden_size, num_layers=layers,
                      snapshot_block=args.block or base.snapshot_block,
                      full_attention_layers=kimi_k3_full_attention_layers(layers),
                      capture_layers=tuple(c for c in base.capture_layers if c < layers - 1),
                      standin_rank=min(base.standin_rank, args.hidden or base.hidden_size))


def _decode_step(args) -> Step:
    return lambda progress, extra: decode.run(quick=args.quick, options=attnres.Options(pdl=not args.no_pdl),
                                              progress=progress, repeats=args.repeats)


def _finalize_step(args) -> Step:
    return lambda progress, extra: finalize.run(quick=args.quick, progress=progress, repeats=args.repeats)


def _chain_step(args) -> Step:
    tokens, config = chain_tokens(args), chain_config(args, "cuda")  # a bad --tokens/--layers fails now
    return lambda progress, extra: chain.run(tokens=tokens, device="cuda", config=config, pdl=not args.no_pdl,
                                             repeats=args.repeats, progress=progress)


def _host_step(args) -> Step:
    return lambda progress, extra: host.run(device="cuda", progress=progress)


# suite -> (args -> Step): the GPU runs of this package's suites (building a step checks its arguments).
SUITE_STEPS = {"decode": _decode_step, "finalize": _finalize_step, "chain": _chain_step, "host": _host_step}


def chains_agree(records: list[dict]) -> bool:
    """The chain suite's correctness checks (fold on = fold off, the fed chain = the model), reported on stderr."""
    bad = sorted({r["T"] for r in records
                  if r.get("suite") == "chain" and not (r["bitwise_equal"] and r["equals_model"])})
    if bad:
        print(f"chain: the fold-on and fold-off chains (or the fed chain and the model) DIFFER at T={bad}",
              file=sys.stderr)
    return not bad


def measure(args, steps: list[Callable[[object], Step]], *, name: str = "attnres.bench", summaries=(chain, host),
            checks=(chains_agree,), targets=results.targets) -> int:
    """A GPU run: the steps (built from args first, so that bad arguments fail before anything is measured) into
    one results file, then each suite's summary, the targets and the correctness checks (exit 1 when one fails
    or the run was interrupted)."""
    if not torch.cuda.is_available():
        print(f"{name} needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out = args.out or "bench_results.json"
    run = [step(args) for step in steps]
    meta = results.metadata(args.commit)
    extra = {}
    records: list[dict] = []
    prog, progress = _progress_printer()
    if prog:
        prog.start()
    try:
        for step in run:
            records += step(progress, extra)
    except KeyboardInterrupt:
        # A wall-clock limit (gpu_check.sh runs the long suites under `timeout -s INT`) or Ctrl-C: keep what was
        # measured rather than losing the whole sweep; the file says it is partial.
        extra["interrupted"] = True
        print("\ninterrupted: saving the records measured so far", file=sys.stderr)
    finally:
        if prog:
            prog.stop()
    results.save(args.out, meta, records, extra)
    print(f"\n{meta['gpu']} commit {meta['commit']}: {len(records)} records -> {args.out}")
    if "floors" in extra:
        launch = extra["floors"].get("launch")
        print(f"floors: copy {extra['floors']['copy_tbs']:.2f} TB/s"
              + (f", launch {launch['median_us']:.2f} us/node" if launch else ""))
    for suite in summaries:
        for line in suite.summary(records):
            print(line)
    for row in targets(records):
        print(f"{row[0]}: {row[1]}: {row[2]} -> {'met' if row[3] else 'MISSED'}")
    ok = all(check(records) for check in checks)
    return 0 if ok and not extra.get("interrupted") else 1


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check_device(p, args, CPU_SUITES)
    if args.suite == "chain" and args.device == "cpu":
        return _chain_cpu(args)
    if args.suite == "host" and args.device == "cpu":
        return _host(args, "cpu")
    return measure(args, [SUITE_STEPS[args.suite]])


def _chain_cpu(args) -> int:
    out = args.out or "bench_results.json"
    meta = results.metadata(args.commit, device="cpu")
    records = chain.run(tokens=chain_tokens(args), device="cpu", config=chain_config(args, "cpu"),
                        pdl=not args.no_pdl, repeats=args.repeats, progress=print_progress)
    results.save(out, meta, records)
    print(f"\nCPU (no graphs; wall clock) commit {meta['commit']}: {len(records)} records -> {out}")
    for line in chain.summary(records):
        print(line)
    return 0 if chains_agree(records) else 1


def _host(args, device: str) -> int:
    records = host.run(device=device)
    results.save(args.out or "bench_results.json", results.metadata(args.commit, device=device), records, {})
    for line in host.summary(records):
        print(line)
    return 0
