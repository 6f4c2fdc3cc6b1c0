"""python -m bench: this repository's own benchmark suites (kernel geometry, floors, the persistent kernel and its
variants, the peers' points, the automatic topology, FP8, the all-reduce, TP, the regression guard, the figures
of docs/perf), run from the root of a checkout against the attnres it imports. Results go to a JSON file keyed by
GPU and commit.

The suites that show a user the speed on their GPU (decode, finalize, chain, host) are the package's:
`python -m attnres.bench`. This command line shares its options and measuring loop (attnres.bench.cli)."""

from __future__ import annotations

import argparse
import sys

import torch

import attnres
from attnres.bench import chain, host, results
from attnres.bench import cli as common
from attnres.models.kimi_k3.config import HIDDEN_RULE, hidden_supported

from . import (allreduce, floors, fp8, fp8_prefill, guard, peers, persistent, persistent_variants, prefill,
               stream_buffers, topology, tp, tune)
from .targets import targets

SUITES = {
    "tune": "the per-token kernels' geometry (kernel, cluster) at T = 1, H = 7168",
    "floors": "copy bandwidth and launch floor of the GPU",
    "persistent": "the persistent kernel vs the per-token kernel vs torch.compile, T = 32..32768, N in {2, 5, 9, "
                  "12}, with and without the addend (about 3 minutes; not part of 'all'; --hidden sets H); "
                  "--variants: the kernel's geometry variants at T = 4096, 16384 x N = 2, 9 instead (about a minute)",
    "peers": "the default options and every kernel forced, one addend, warm and cold L2, at the points of the "
             "kernels issue's side-by-side table (against the peers' figures of that run) and T = 1024..16384 x "
             "N = 2, 9, 12, H = 7168 (not part of 'all'; --quick: 5 points)",
    "topology": "the automatic topology against every kernel forced, one addend, cold L2, T = 128..4096 x N = "
                "3..16, H = 7168 (about 2 minutes; not part of 'all'; --quick: 15 points; --no-add: "
                "attn_res_rmsnorm at N = 1..16; --mix: attn_res without the fp32 diagnostics)",
    "prefill": "every attention op (attn_res, attn_res_rmsnorm, one addend, two) under the default options at "
               "T = 1024, 4096, 16384 x N = 1..16, H = 7168, cold L2, against the copy rate (not part of 'all'; "
               "--quick: T = 4096 x 6 N; --tokens and --candidates choose the points; --forced: every kernel too, and per N "
               "the T from which the persistent kernel wins by >= 3 %)",
    "stream": "the streaming single_cta's token buffers (2, 3, 4) and the token-block kernel against the default "
              "and split_k, with and without the addend, T = 256, 1024, 4096, 16384 x N = 1..4, H = 7168, cold L2, "
              "each checked bitwise (not part of 'all'; --tokens and --candidates choose the points, N <= 4)",
    "tp": "the decode step under tensor parallelism (2 ranks: under torchrun, or spawned), all-reduce time "
          "separated, plus all-reduce and op latencies (docs/tp.md)",
    "fp8": "the FP8 epilogue's cost over the bf16 add2 op (per_token, block128) against the bf16 op + a separate "
           "quantization (eager, torch.compile), T = 1, 4, 8, 32, N = 2, 9, 12, H = 7168 (not part of 'all'); "
           "--prefill: attn_res_rmsnorm, one addend and two with FP8 (with the bf16 output and without: "
           "fp8_only) against bf16 under the default options, "
           "T = 1024, 4096 x N = 1..12, cold L2 (--quick: 3 points)",
    "allreduce": "the fused all-reduce epilogues in the in-process W = 2 world on one GPU (a lower bound: local "
                 "memory instead of NVLink) against the plain op and the unfused all_reduce + op, T = 1..32",
    "guard": "a quick check of key points against --baseline; non-zero exit on a regression",
    "all": "floors, decode, tune, finalize and chain",
    "plot": "draw the PNGs of existing results files (--out, comma-separated) into --plots (no GPU needed)",
}
CPU_SUITES = ("tp", "allreduce")  # the suites --device cpu applies to

# The common options' help, for this command line's suites (attnres.bench.cli.HELP: the package's).
HELP = {
    "out": "results file (JSON; default bench_results.json; guard: where to write its measurements, none when "
           "omitted)",
    "no_pdl": "decode, chain, persistent and guard without programmatic dependent launch",
    "device": "cpu: the chain (tp: over gloo; allreduce: the in-process world) on the CPU backend with a small "
              "config, timed eagerly by wall clock (no graphs): exercises the code, measures nothing",
    "tokens": "comma-separated T values (default 1,4,8,32; --quick: 1,32; tp: 1,8; allreduce --quick: 1,8, its MoE "
              "finalize 1,8,16,32; topology, prefill, stream and persistent --variants: the grid's T values "
              "instead)",
    "hidden": "hidden size (chain, tp: default 7168 on cuda, 256 on cpu; persistent: default 7168)",
    "layers": "decoder layers (default 93 on cuda; on cpu 26, tp: 10)",
}


def parser() -> argparse.ArgumentParser:
    p = common.new_parser("python -m bench", __doc__.split("\n\n")[0], SUITES)
    common.add_common_arguments(p, HELP)
    p.add_argument("--plots", default="docs/perf", help="plot: where the PNGs go (default docs/perf)")
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
                        "interleaved against the copy floor, each checked bitwise (docs/performance.md); "
                        "--tokens, --candidates and --no-add choose its points")
    v.add_argument("--candidates", default=None,
                   help="persistent --variants, prefill and stream: comma-separated N values (default 2,9; prefill: "
                        "1..16; stream: 1..4)")
    r = p.add_argument_group("prefill")
    r.add_argument("--forced", action="store_true",
                   help="prefill: also time every kernel the call can run on, forced, interleaved with the default")
    r.add_argument("--ops", default=None,
                   help="prefill: comma-separated ops among mix, norm, add, add2 (default: all four); stream: among "
                        "norm, mix (default: norm)")
    o = p.add_argument_group("topology")
    o.add_argument("--no-add", action="store_true",
                   help="topology: the op without an addend (attn_res_rmsnorm) at N = 1..16 instead of the one-addend "
                        "op; persistent --variants: without the addend")
    o.add_argument("--mix", action="store_true",
                   help="topology: attn_res (no trailing norm, no fp32 diagnostics) instead of the normed op, with the "
                        "addend or, with --no-add, without it")
    f = p.add_argument_group("fp8")
    f.add_argument("--pow2", action="store_true", help="fp8: power-of-two scales (fp8_pow2_scales=True)")
    f.add_argument("--prefill", action="store_true",
                   help="fp8: the prefill grid (every normed op, T = 1024, 4096, cold L2, the default options)")
    f.add_argument("--fp8", choices=fp8.MODES, default=None,
                   help="stream: every variant makes the FP8-only call (fp8=MODE, fp8_only) of the normed ops, beside "
                        "the bf16 call under the default options (default_bf16)")
    g = p.add_argument_group("guard")
    g.add_argument("--baseline", default=None,
                   help="results file to compare with (e.g. bench_results/h200_4aed4f9.json)")
    g.add_argument("--against", default=None,
                   help="compare this existing results file instead of measuring (no GPU needed)")
    return p


def _copy_floor(extra: dict) -> float:
    """The device's copy bandwidth, measured now and kept in the results file's floors."""
    extra["floors"] = {"copy_tbs": floors.copy_bandwidth_tbs()}
    return extra["floors"]["copy_tbs"]


def _floors_step(args) -> common.Step:
    def step(progress, extra):
        extra["floors"] = {"copy_tbs": floors.copy_bandwidth_tbs(), "launch": floors.launch_floor_us()}
        return []

    return step


def _tune_step(args) -> common.Step:
    return lambda progress, extra: tune.run(quick=args.quick, progress=progress)


def _fp8_step(args) -> common.Step:
    if args.prefill:
        return lambda progress, extra: fp8_prefill.run(quick=args.quick, progress=progress, repeats=args.repeats)
    return lambda progress, extra: fp8.run(quick=args.quick, options=attnres.Options(pdl=not args.no_pdl),
                                           progress=progress, repeats=args.repeats, pow2=args.pow2)


def _peers_step(args) -> common.Step:
    return lambda progress, extra: peers.run(quick=args.quick, copy_tbs=_copy_floor(extra), progress=progress,
                                             repeats=args.repeats)


def _topology_step(args) -> common.Step:
    return lambda progress, extra: topology.run(quick=args.quick, copy_tbs=_copy_floor(extra), progress=progress,
                                                repeats=args.repeats, add=not args.no_add, mix=args.mix,
                                                tokens=common.chain_tokens(args) if args.tokens else None)


def _candidates(args, p) -> tuple[int, ...]:
    try:
        values = tuple(int(n) for n in args.candidates.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        p.error(f"--candidates must be comma-separated integers >= 1, got {args.candidates!r}")
    return values


def _persistent_step(args) -> common.Step:
    if not args.variants:
        return lambda progress, extra: persistent.run(quick=args.quick, H=args.hidden or persistent.H_DEFAULT,
                                                      pdl=not args.no_pdl, copy_tbs=_copy_floor(extra),
                                                      progress=progress, repeats=args.repeats)
    points = {"add": not args.no_add}
    if args.tokens:
        points["tokens"] = common.chain_tokens(args)
    if args.candidates_values:
        points["candidates"] = args.candidates_values
    return lambda progress, extra: persistent_variants.run(H=args.hidden or persistent.H_DEFAULT,
                                                           pdl=not args.no_pdl, copy_tbs=_copy_floor(extra),
                                                           progress=progress, repeats=args.repeats, **points)


def _prefill_step(args) -> common.Step:
    points = {"tokens": common.chain_tokens(args) if args.tokens else None, "candidates": args.candidates_values,
              "ops": tuple(args.ops.split(",")) if args.ops else None}
    return lambda progress, extra: prefill.run(quick=args.quick, copy_tbs=_copy_floor(extra), progress=progress,
                                               repeats=args.repeats, forced=args.forced, **points)


def _stream_step(args) -> common.Step:
    points = {}
    if args.tokens:
        points["tokens"] = common.chain_tokens(args)
    if args.candidates_values:
        points["candidates"] = args.candidates_values
    if args.ops:
        points["ops"] = tuple(args.ops.split(","))
    return lambda progress, extra: stream_buffers.run(pdl=not args.no_pdl, copy_tbs=_copy_floor(extra),
                                                      progress=progress, repeats=args.repeats, fp8=args.fp8,
                                                      **points)


# suite -> its steps, in order (all: the package's decode, finalize and chain among this harness's floors and tune).
STEPS = {
    "floors": [_floors_step],
    "tune": [_tune_step],
    "fp8": [_fp8_step],
    "peers": [_peers_step],
    "topology": [_topology_step],
    "persistent": [_persistent_step],
    "prefill": [_prefill_step],
    "stream": [_stream_step],
    "all": [_floors_step, common.SUITE_STEPS["decode"], _tune_step, common.SUITE_STEPS["finalize"],
            common.SUITE_STEPS["chain"]],
}


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.suite == "plot":
        from .plots import make_plots

        for path in make_plots((args.out or "bench_results.json").split(","), args.plots):
            print(path)
        return 0
    common.check_device(p, args, CPU_SUITES)
    if args.variants and args.suite != "persistent":
        p.error("--variants applies to the persistent suite only")
    if args.no_add and args.suite != "topology" and not args.variants:
        p.error("--no-add applies to the topology suite and persistent --variants only")
    if args.candidates is not None and not args.variants and args.suite not in ("prefill", "stream"):
        p.error("--candidates applies to persistent --variants, prefill and stream only")
    args.candidates_values = _candidates(args, p) if args.candidates is not None else None
    if args.forced and args.suite != "prefill":
        p.error("--forced applies to the prefill suite only")
    if args.ops is not None and args.suite not in ("prefill", "stream"):
        p.error("--ops applies to the prefill and stream suites only")
    ops = prefill.OPS if args.suite == "prefill" else stream_buffers.OPS
    if args.ops is not None and (not args.ops or any(op not in ops for op in args.ops.split(","))):
        p.error(f"{args.suite}: --ops must be a comma-separated subset of {','.join(ops)}, got {args.ops!r}")
    if args.suite == "prefill" and args.candidates_values and \
            max(args.candidates_values) > (most := attnres._C.limits["max_candidates"]):
        p.error(f"prefill: --candidates must be <= {most}, got {args.candidates!r}")
    if args.suite == "stream" and args.candidates_values and max(args.candidates_values) > 4:
        p.error(f"stream: --candidates must be <= 4 (the streaming kernel's N buckets), got {args.candidates!r}")
    if args.prefill and args.suite != "fp8":
        p.error("--prefill applies to the fp8 suite only")
    if args.fp8 is not None and args.suite != "stream":
        p.error("--fp8 applies to the stream suite only")
    if args.fp8 is not None and args.ops is not None and "mix" in args.ops.split(","):
        p.error("stream --fp8: attn_res (op mix) has no normed output to quantize")
    if args.prefill and (args.pow2 or args.no_pdl):
        p.error("fp8 --prefill runs the default options: drop --pow2 and --no-pdl")
    if args.mix and args.suite != "topology":
        p.error("--mix applies to the topology suite only")
    if args.variants and args.quick:
        p.error("--variants has one grid (T = 4096, 16384 x N = 2, 9; --tokens and --candidates choose others): "
                "drop --quick")
    if args.suite == "persistent" and args.hidden is not None and not hidden_supported(args.hidden):
        p.error(f"--hidden must be {HIDDEN_RULE}, got {args.hidden}")
    if args.suite == "tp":
        return _tp(args, p)
    if args.suite == "guard":
        return _guard(args)
    if args.suite == "allreduce":
        return _allreduce(args)
    return common.measure(args, STEPS[args.suite], name="bench",
                          summaries=(chain, persistent, persistent_variants, stream_buffers, fp8, fp8_prefill, peers,
                                     topology, prefill, host),
                          checks=(common.chains_agree, fp8_agrees, variants_agree, stream_agrees), targets=targets)


def variants_agree(records: list[dict]) -> bool:
    """The persistent variants' correctness check (every geometry = the per-token kernel's bits), on stderr."""
    bad = persistent_variants.differing(records)
    if bad:
        print(f"persistent variants: output bits DIFFER from the per-token kernel's at (T, N, H, variant) = {bad}",
              file=sys.stderr)
    return not bad


def stream_agrees(records: list[dict]) -> bool:
    """The stream suite's correctness check (every buffer count = split_k's bits), on stderr."""
    bad = stream_buffers.differing(records)
    if bad:
        print(f"stream buffers: output bits DIFFER from split_k's at (T, N, add, op, variant) = {bad}", file=sys.stderr)
    return not bad


def fp8_agrees(records: list[dict]) -> bool:
    """The fp8 suite's correctness check (fused codes and scales = the reference quantization), on stderr; with
    --prefill, (op, T, N, mode)."""
    bad = sorted({(r["T"], r["N"], r["mode"]) for r in records
                  if r.get("suite") == "fp8" and r.get("bitwise_equal") is False}) + fp8_prefill.differing(records)
    if bad:
        print(f"fp8: the fused FP8 output DIFFERS from quantize(output) at {bad}", file=sys.stderr)
    return not bad


def _tp(args, parser) -> int:
    if args.nproc < 2:
        parser.error("--nproc must be >= 2 (tensor parallelism needs ranks to reduce over)")
    args.tokens = common.chain_tokens(args) if args.tokens is not None else tp.TOKENS
    custom = args.hidden is not None or args.layers is not None or args.block is not None
    args.config = common.chain_config(args, args.device) if custom else None
    return tp.main(args)


def _allreduce(args) -> int:
    if args.tokens is None:
        tokens = allreduce.QUICK_TOKENS if args.quick else allreduce.TOKENS
        moe_tokens = allreduce.QUICK_MOE_TOKENS if args.quick else allreduce.MOE_TOKENS
    else:
        tokens = moe_tokens = common.chain_tokens(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench allreduce needs a CUDA GPU (or --device cpu, which measures nothing)", file=sys.stderr)
        return 2
    out = args.out or "bench_results.json"
    meta = results.metadata(args.commit, device=args.device)
    records = allreduce.run(tokens=tokens, moe_tokens=moe_tokens, device=args.device, repeats=args.repeats,
                            progress=common.print_progress)
    results.save(out, meta, records, {"note": allreduce.LOWER_BOUND if args.device == "cuda" else allreduce.CPU_NOTE})
    print(f"\n{meta['gpu'] or 'CPU'} commit {meta['commit']}: {len(records)} records -> {out}")
    for line in allreduce.summary(records):
        print(line)
    if not all(r["bitwise_equal"] for r in records):
        print("allreduce: the fused and unfused paths DIFFER (see bitwise_equal)", file=sys.stderr)
        return 1
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
                                        progress=common.print_progress)
            if args.out:
                results.save(args.out, new_meta, new_records, {"guard_baseline": args.baseline})
    except (OSError, ValueError) as e:
        print(f"guard: {e}", file=sys.stderr)
        return 2
    report = guard.compare(base_records, new_records, base_meta=base_meta, new_meta=new_meta)
    for line in guard.format_report(report):
        print(line)
    return report.exit_code()
