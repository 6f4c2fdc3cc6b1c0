"""python -m attnres.bench: the GPU benchmark suites. Results go to a JSON file keyed by GPU and commit."""

from __future__ import annotations

import argparse
import sys

import torch

import attnres
from attnres.models.kimi_k3.config import HIDDEN_RULE, hidden_supported

from . import (allreduce, chain, decode, finalize, floors, fp8, guard, host, peers, persistent, persistent_variants,
               results, topology, tp, tune)


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


SUITES = {
    "decode": "the ops against torch eager and torch.compile of the same step, T = 1..32, N = 2..16, H = 7168",
    "tune": "the per-token kernels' geometry (kernel, cluster) at T = 1, H = 7168",
    "finalize": "the fused MoE finalize against the unfused PyTorch sequence, k = 16, D = 3584",
    "floors": "copy bandwidth and launch floor of the GPU",
    "chain": "the 93-layer Kimi K3 decode step, MoE-tail fold on vs off, one CUDA graph per step",
    "persistent": "the persistent kernel vs the per-token kernel vs torch.compile, T = 32..32768, N in {2, 5, 9, "
                  "12}, with and without the addend (about 3 minutes; not part of 'all'; --hidden sets H); "
                  "--variants: the kernel's geometry variants at T = 4096, 16384 x N = 2, 9 instead (about a minute)",
    "peers": "the default options and every kernel forced, one addend, warm and cold L2, at the points of the "
             "kernels issue's side-by-side table (against the peers' figures of that run) and T = 1024..16384 x "
             "N = 2, 9, 12, H = 7168 (not part of 'all'; --quick: 5 points)",
    "topology": "the automatic topology against every kernel forced, one addend, cold L2, T = 128..4096 x N = "
                "3..16, H = 7168 (about 2 minutes; not part of 'all'; --quick: 15 points)",
    "tp": "the decode step under tensor parallelism (2 ranks: under torchrun, or spawned), all-reduce time "
          "separated, plus all-reduce and op latencies (docs/tp.md)",
    "fp8": "the FP8 epilogue's cost over the bf16 add2 op (per_token, block128) against the bf16 op + a separate "
           "quantization (eager, torch.compile), T = 1, 4, 8, 32, N = 2, 9, 12, H = 7168 (not part of 'all')",
    "allreduce": "the fused all-reduce epilogues in the in-process W = 2 world on one GPU (a lower bound: local "
                 "memory instead of NVLink) against the plain op and the unfused all_reduce + op, T = 1..32",
    "host": "the host cost of one eager call (T = 1, N = 9, H = 7168), issued back to back, against an eager "
            "add + rms_norm and torch.empty_like in the same run (--device cpu: on the CPU backend)",
    "guard": "a quick check of key points against --baseline; non-zero exit on a regression",
    "all": "floors, decode, tune, finalize and chain",
    "plot": "draw the PNGs of existing results files (--out, comma-separated) into --plots (no GPU needed)",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnres.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="suites:\n" + "\n".join(f"  {name:<11} {line}" for name, line in SUITES.items())
                                       + "\n\nMethod and current figures: docs/performance.md.")
    p.add_argument("suite", choices=list(SUITES), metavar="SUITE", help="which suite to run (listed below)")
    p.add_argument("--quick", action="store_true", help="a reduced grid of the chosen suite")
    p.add_argument("--out", default=None, help="results file (JSON; default bench_results.json; guard: where to "
                                               "write its measurements, none when omitted)")
    p.add_argument("--commit", default=None, help="commit the numbers belong to (default: git HEAD)")
    p.add_argument("--no-pdl", action="store_true",
                   help="decode, chain, persistent and guard without programmatic dependent launch")
    p.add_argument("--repeats", type=int, default=25, help="timed replays per variant, interleaved (default 25)")
    p.add_argument("--plots", default="docs/perf", help="plot: where the PNGs go (default docs/perf)")
    c = p.add_argument_group("chain")
    c.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the chain (tp: over gloo; allreduce: the in-process world) on the CPU backend with a "
                        "small config, timed eagerly by wall clock (no graphs): exercises the code, measures nothing")
    c.add_argument("--tokens", default=None,
                   help="comma-separated T values (default 1,4,8,32; --quick: 1,32; tp: 1,8; allreduce --quick: 1,8, its MoE finalize 1,8,16,32)")
    c.add_argument("--hidden", type=int, default=None,
                   help="hidden size (chain, tp: default 7168 on cuda, 256 on cpu; persistent: default 7168)")
    c.add_argument("--layers", type=int, default=None, help="decoder layers (default 93 on cuda; on cpu 26, tp: 10)")
    c.add_argument("--block", type=int, default=None, help="snapshot block (default 12 on cuda, 4 on cpu)")
    t = p.add_argument_group("tp")
    t.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun (default 2)")
    t.add_argument("--no-latencies", action="store_true", help="the chain only (no all-reduce/op latency sweep)")
    t.add_argument("--latencies-only", action="store_true",
                   help="the all-reduce/op latency sweep only (no chain): e.g. --symm-mem in a process of its own, "
                        "so that a failure there cannot take the chain's numbers with it")
    t.add_argument("--symm-mem", action="store_true",
                   help="also time torch's symmetric-memory one-shot all-reduce (P2P over NVLink, no multicast)")
    v = p.add_argument_group("persistent")
    v.add_argument("--variants", action="store_true",
                   help="persistent: time the kernel's geometry variants (blocks per SM, ring slots, passes) "
                        "interleaved against the copy floor, each checked bitwise (docs/performance.md)")
    f = p.add_argument_group("fp8")
    f.add_argument("--pow2", action="store_true", help="fp8: power-of-two scales (fp8_pow2_scales=True)")
    g = p.add_argument_group("guard")
    g.add_argument("--baseline", default=None,
                   help="results file to compare with (e.g. bench_results/h200_4aed4f9.json)")
    g.add_argument("--against", default=None,
                   help="compare this existing results file instead of measuring (no GPU needed)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.suite == "plot":
        from .plots import make_plots

        for path in make_plots((args.out or "bench_results.json").split(","), args.plots):
            print(path)
        return 0
    if args.device == "cpu" and args.suite not in ("chain", "tp", "allreduce", "host"):
        p.error("--device cpu applies to the chain, tp, allreduce and host suites only")
    if args.variants and args.suite != "persistent":
        p.error("--variants applies to the persistent suite only")
    if args.variants and args.quick:
        p.error("--variants has one grid (T = 4096, 16384 x N = 2, 9): drop --quick")
    if args.suite == "persistent" and args.hidden is not None and not hidden_supported(args.hidden):
        p.error(f"--hidden must be {HIDDEN_RULE}, got {args.hidden}")
    if args.suite == "tp":
        return _tp(args, p)
    if args.suite == "guard":
        return _guard(args)
    if args.suite == "allreduce":
        return _allreduce(args)
    if args.suite == "chain" and args.device == "cpu":
        return _chain_cpu(args)
    if args.suite == "host" and args.device == "cpu":
        return _host(args, "cpu")
    if not torch.cuda.is_available():
        print("attnres.bench needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out = args.out or "bench_results.json"
    if args.suite in ("chain", "all"):  # a bad --tokens/--layers fails now, not after the other suites ran
        chain_tokens, chain_config = _chain_tokens(args), _chain_config(args, "cuda")

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
        if args.suite in ("chain", "all"):
            records += chain.run(tokens=chain_tokens, device="cuda", config=chain_config, pdl=not args.no_pdl,
                                 repeats=args.repeats, progress=progress)
        if args.suite == "host":
            records += host.run(device="cuda", progress=progress)
        if args.suite == "fp8":
            records += fp8.run(quick=args.quick, options=attnres.Options(pdl=not args.no_pdl), progress=progress,
                               repeats=args.repeats, pow2=args.pow2)
        if args.suite == "peers":
            extra["floors"] = {"copy_tbs": floors.copy_bandwidth_tbs()}
            records += peers.run(quick=args.quick, copy_tbs=extra["floors"]["copy_tbs"], progress=progress,
                                 repeats=args.repeats)
        if args.suite == "topology":
            extra["floors"] = {"copy_tbs": floors.copy_bandwidth_tbs()}
            records += topology.run(quick=args.quick, copy_tbs=extra["floors"]["copy_tbs"], progress=progress,
                                    repeats=args.repeats)
        if args.suite == "persistent":
            copy_tbs = extra["floors"]["copy_tbs"] if "floors" in extra else floors.copy_bandwidth_tbs()
            extra.setdefault("floors", {})["copy_tbs"] = copy_tbs
            suite = persistent_variants if args.variants else persistent
            records += suite.run(**({} if args.variants else {"quick": args.quick}),
                                 H=args.hidden or persistent.H_DEFAULT, pdl=not args.no_pdl, copy_tbs=copy_tbs,
                                 progress=progress, repeats=args.repeats)
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
    for suite in (chain, persistent, persistent_variants, fp8, peers, topology, host):
        for line in suite.summary(records):
            print(line)
    for row in results.targets(records):
        print(f"{row[0]}: {row[1]}: {row[2]} -> {'met' if row[3] else 'MISSED'}")
    ok = _chains_agree(records) and _fp8_agrees(records) and _variants_agree(records)
    return 0 if ok and not extra.get("interrupted") else 1


def _variants_agree(records: list[dict]) -> bool:
    """The persistent variants' correctness check (every geometry = the per-token kernel's bits), on stderr."""
    bad = persistent_variants.differing(records)
    if bad:
        print(f"persistent variants: output bits DIFFER from the per-token kernel's at (T, N, H, variant) = {bad}",
              file=sys.stderr)
    return not bad


def _fp8_agrees(records: list[dict]) -> bool:
    """The fp8 suite's correctness check (fused codes and scales = the reference quantization), on stderr."""
    bad = sorted({(r["T"], r["N"], r["mode"]) for r in records
                  if r.get("suite") == "fp8" and r.get("bitwise_equal") is False})
    if bad:
        print(f"fp8: the fused FP8 output DIFFERS from quantize(output) at (T, N, mode) = {bad}", file=sys.stderr)
    return not bad


def _chains_agree(records: list[dict]) -> bool:
    """The chain suite's correctness checks (fold on = fold off, the fed chain = the model), reported on stderr."""
    bad = sorted({r["T"] for r in records
                  if r.get("suite") == "chain" and not (r["bitwise_equal"] and r["equals_model"])})
    if bad:
        print(f"chain: the fold-on and fold-off chains (or the fed chain and the model) DIFFER at T={bad}",
              file=sys.stderr)
    return not bad


def _print_progress(i: int, n: int, what: str) -> None:
    print(f"[{i}/{n}] {what}", flush=True)


def _chain_tokens(args) -> tuple[int, ...]:
    if args.tokens is None:
        return chain.QUICK_TOKENS if args.quick else chain.TOKENS
    try:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        raise SystemExit(f"--tokens must be comma-separated integers >= 1, got {args.tokens!r}")
    return tokens


def _chain_config(args, device: str):
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


def _chain_cpu(args) -> int:
    out = args.out or "bench_results.json"
    meta = results.metadata(args.commit, device="cpu")
    records = chain.run(tokens=_chain_tokens(args), device="cpu", config=_chain_config(args, "cpu"),
                        pdl=not args.no_pdl, repeats=args.repeats, progress=_print_progress)
    results.save(out, meta, records)
    print(f"\nCPU (no graphs; wall clock) commit {meta['commit']}: {len(records)} records -> {out}")
    for line in chain.summary(records):
        print(line)
    return 0 if _chains_agree(records) else 1


def _tp(args, parser) -> int:
    if args.nproc < 2:
        parser.error("--nproc must be >= 2 (tensor parallelism needs ranks to reduce over)")
    args.tokens = _chain_tokens(args) if args.tokens is not None else tp.TOKENS
    custom = args.hidden is not None or args.layers is not None or args.block is not None
    args.config = _chain_config(args, args.device) if custom else None
    return tp.main(args)


def _allreduce(args) -> int:
    if args.tokens is None:
        tokens = allreduce.QUICK_TOKENS if args.quick else allreduce.TOKENS
        moe_tokens = allreduce.QUICK_MOE_TOKENS if args.quick else allreduce.MOE_TOKENS
    else:
        tokens = moe_tokens = _chain_tokens(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("attnres.bench allreduce needs a CUDA GPU (or --device cpu, which measures nothing)", file=sys.stderr)
        return 2
    out = args.out or "bench_results.json"
    meta = results.metadata(args.commit, device=args.device)
    records = allreduce.run(tokens=tokens, moe_tokens=moe_tokens, device=args.device, repeats=args.repeats,
                            progress=_print_progress)
    results.save(out, meta, records, {"note": allreduce.LOWER_BOUND if args.device == "cuda" else allreduce.CPU_NOTE})
    print(f"\n{meta['gpu'] or 'CPU'} commit {meta['commit']}: {len(records)} records -> {out}")
    for line in allreduce.summary(records):
        print(line)
    if not all(r["bitwise_equal"] for r in records):
        print("allreduce: the fused and unfused paths DIFFER (see bitwise_equal)", file=sys.stderr)
        return 1
    return 0


def _host(args, device: str) -> int:
    records = host.run(device=device)
    results.save(args.out or "bench_results.json", results.metadata(args.commit, device=device), records, {})
    for line in host.summary(records):
        print(line)
    return 0


def _guard(args) -> int:
    if not args.baseline:
        print("guard: --baseline FILE is required (e.g. bench_results/h200_4aed4f9.json)", file=sys.stderr)
        return 2
    try:
        base_meta, base_records = guard.load(args.baseline)
        if args.against:
            new_meta, new_records = guard.load(args.against)
        else:
            if not torch.cuda.is_available():
                print("guard: measuring needs a CUDA GPU (or --against FILE)", file=sys.stderr)
                return 2
            new_meta = results.metadata(args.commit)
            new_records = guard.measure(repeats=args.repeats, options=attnres.Options(pdl=not args.no_pdl),
                                        progress=_print_progress)
            if args.out:
                results.save(args.out, new_meta, new_records, {"guard_baseline": args.baseline})
    except (OSError, ValueError) as e:
        print(f"guard: {e}", file=sys.stderr)
        return 2
    report = guard.compare(base_records, new_records, base_meta=base_meta, new_meta=new_meta)
    for line in guard.format_report(report):
        print(line)
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
