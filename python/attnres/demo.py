"""python -m attnres demo: the Kimi K3 decode step with the MoE-tail fold off and on.

The step is the one the decode-chain benchmark times (attnres.bench.chain.run_point): the residual stream of
every layer (the attention-residual sites, the snapshot writes, the MoE tails) with the attention and MoE
sub-layers fed their recorded outputs. For each T the demo reports

* which path and kernel each kind of site took, with the fold off and on;
* whether the two chains agree bit for bit (every site's prefix, output and tap, the bank, the model output)
  and whether they reproduce the model's own eager step;
* the step time. On a Hopper GPU each step is captured as one CUDA graph and the two graphs are replayed
  interleaved, which is how a decode step runs in an engine: the fold's saving (two bf16 adds per MoE layer and
  their launches) is what this measures. On the CPU the step runs eagerly and the wall clock is dominated by
  Python dispatch, so the timings are shown with their spread and a verdict on whether the difference is
  outside it; they are not a measurement of the fold.
"""

from __future__ import annotations

import sys
import time

import torch

import attnres

CPU_NOTE = ("CPU timings are not the point of the demo: the step runs eagerly and the wall clock is dominated by "
            "Python dispatch. The fold's saving is measured on a Hopper GPU under CUDA-graph replay "
            "(docs/performance.md).")

# What the fold saves on an H200: the committed results of `python -m attnres.bench chain` (93 layers, H = 7168,
# one CUDA graph per step, median of 25 replays), copied here so an installed package can show them; the figures
# are those of the file (tests/tools/test_docs.py compares them). T: (fold off, fold on) median step time in µs.
H200_CHAIN_FILE = "bench_results/h200_f1e3a16_chain.json"
H200_CHAIN_US = {1: (726.30, 447.17), 4: (896.32, 503.01), 8: (925.73, 526.66), 32: (1076.38, 646.56)}
H200_MOE_LAYERS = 92


def h200_lines() -> list[str]:
    """The committed H200 figures, labelled as such: a CPU run cannot measure the fold."""
    lines = [f"\nwhat the fold saves on an H200 (committed results {H200_CHAIN_FILE}, not this run; 93 layers, "
             "H = 7168, CUDA-graph replay):"]
    for t, (off, on) in H200_CHAIN_US.items():
        lines.append(f"    T = {t:>3}: fold off {off / 1e3:.3f} ms, fold on {on / 1e3:.3f} ms: saves "
                     f"{(off - on) / 1e3:.3f} ms per step = {(off - on) / H200_MOE_LAYERS:.2f} us per MoE layer")
    return lines


def pick_device(choice: str) -> str:
    """'auto': cuda when attnres has the CUDA backend and a Hopper GPU is present, else cpu."""
    if choice != "auto":
        return choice
    info = attnres.backend_info()
    hopper = any(int(d["cc"].split(".")[0]) >= 9 for d in info["cuda_devices"])
    return "cuda" if info["cuda_backend"] and hopper and torch.cuda.is_available() else "cpu"


def demo_config(device: str, *, real: bool = False, hidden: int | None = None, layers: int | None = None,
                block: int | None = None, seed: int = 0):
    """Kimi K3's real config on CUDA (or with real=True), the tools' small CPU config otherwise; hidden, layers
    and block override either (with the MLA layers and taps of the new depth)."""
    from attnres.models.kimi_k3 import KimiK3Config, kimi_k3_full_attention_layers

    base = KimiK3Config.real() if (real or device == "cuda") else KimiK3Config.cpu()
    if hidden is None and layers is None and block is None:
        return base.with_(seed=seed)
    n = layers or base.num_layers
    h = hidden or base.hidden_size
    return base.with_(hidden_size=h, num_layers=n, snapshot_block=block or base.snapshot_block,
                      full_attention_layers=kimi_k3_full_attention_layers(n),
                      capture_layers=tuple(c for c in base.capture_layers if c < n - 1),
                      standin_rank=min(base.standin_rank, h), seed=seed)


def run(config, tokens: tuple[int, ...], *, device: str, repeats: int, pdl: bool = True, seed: int = 0) -> list[dict]:
    """The chain benchmark's records (two per T: fold on, fold off), measured as `python -m attnres.bench chain`
    measures them."""
    from attnres.bench import chain
    from attnres.models.kimi_k3 import KimiK3Model, ResidualSettings

    model = KimiK3Model(config, settings=ResidualSettings(fold=False, pdl=pdl), device=device, keep_paths=False)
    records = []
    for T in tokens:
        records += chain.run_point(model, T, device=device, pdl=pdl, repeats=repeats, seed=seed)
    return records


def _pairs(records: list[dict]) -> list[tuple[dict, dict]]:
    """(fold off, fold on) per T, in the order measured."""
    by_t: dict[int, dict[bool, dict]] = {}
    for r in records:
        by_t.setdefault(r["T"], {})[r["fold"]] = r
    return [(pair[False], pair[True]) for pair in by_t.values()]


def _paths_lines(record: dict) -> list[str]:
    from attnres.models.kimi_k3.residual import SITE_KINDS

    order = {kind: i for i, kind in enumerate(SITE_KINDS)}
    lines = []
    for kind, path, kernel, reason, n in sorted(record["paths"], key=lambda p: (order.get(p[0], 9), p[:4])):
        what = path + (f" [{kernel}]" if kernel else "") + (f" ({reason})" if reason else "")
        lines.append(f"    {kind:<9} {what:<40} x{n}")
    return lines


def timing_verdict(off: dict, on: dict) -> str:
    """Whether the step-time difference is outside the run-to-run spread (the two p10-p90 ranges combined, as
    the chain benchmark's saving_noise_us)."""
    diff, noise = off["median_us"] - on["median_us"], on["saving_noise_us"]
    what = f"off - on = {diff / 1e3:+.3f} ms, spread {noise / 1e3:.3f} ms"
    if abs(diff) <= noise:
        return f"{what}: within the spread, no measurable difference"
    return f"{what}: outside the spread, fold {'on' if diff > 0 else 'off'} is faster in this run"


def _ms(r: dict) -> str:
    return f"{r['median_us'] / 1e3:7.3f} ms (p10-p90 {r['p10_us'] / 1e3:.3f}-{r['p90_us'] / 1e3:.3f})"


def report(records: list[dict], config, device: str) -> tuple[list[str], bool]:
    """The demo's lines and whether every check passed."""
    lines, ok = [], True
    pairs = _pairs(records)
    off0, on0 = pairs[0]
    for fold, r in (("off", off0), ("on ", on0)):
        lines.append(f"\nfold {fold}: paths of one step at T = {r['T']}, per site kind [kernel] (reason)")
        lines += _paths_lines(r)
    p = on0["plan_add2"]
    lines.append(f"\n  attnres.plan(attn_res_add_rmsnorm, add2, T={on0['T']}, N={p['N']}, H={config.hidden_size}): "
                 + (f"declined: {p['decline']}" if p["decline"] else f"kernel {p['kernel']}"
                    + (f", cluster {p['cluster']}, {p['threads']} threads, pdl {p['pdl']}" if device == "cuda" else "")))
    lines.append("\nbitwise, fold on vs fold off (every site's prefix, output and tap, the bank, the model output):")
    for off, on in pairs:
        same = on["bitwise_equal"] and on["equals_model"]
        ok = ok and same
        lines.append(f"    T = {on['T']:>3}: {'identical' if on['bitwise_equal'] else 'DIFFERENT'} over {on['sites']} "
                     f"sites, {on['folded_sites']} of them folded; the timed chains "
                     f"{'equal' if on['equals_model'] else 'DIFFER FROM'} the model's eager step")
        lines += [f"        {d}" for d in (on["diffs"] + on["model_diffs"])[:5]]
    repeats = on0["repeats"]
    if device == "cuda":
        lines.append(f"\nstep time, CUDA-graph replay of one decode step (one graph per variant, replayed interleaved, "
                     f"median of {repeats}):")
        for off, on in pairs:
            lines.append(f"    T = {on['T']:>3}: fold off {_ms(off)}, fold on {_ms(on)}: saves "
                         f"{on['step_saving_us']:.1f} us per step = {on['saving_per_moe_layer_us']:.2f} us per MoE "
                         f"layer (noise {on['saving_noise_us']:.1f} us)")
    else:
        lines.append(f"\nstep time, CPU, eager, wall clock (median of {repeats}, interleaved):")
        for off, on in pairs:
            lines.append(f"    T = {on['T']:>3}: fold off {_ms(off)}, fold on {_ms(on)}")
            lines.append(f"             {timing_verdict(off, on)}")
        lines.append("  " + CPU_NOTE)
        lines += h200_lines()
    return lines, ok


def cpu_figure(plt, records: list[dict], where: str):
    """The CPU run's figure: what it measured, the eager step's wall clock with its p10-p90 spread per variant.
    No saving per MoE layer: on the CPU the difference is Python dispatch and noise, not the fold."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    pairs = _pairs(records)
    ts = [on["T"] for _, on in pairs]
    for i, (label, pick) in enumerate((("fold off", 0), ("fold on", 1))):
        rs = [pair[pick] for pair in pairs]
        med = [r["median_us"] / 1e3 for r in rs]
        err = [[(r["median_us"] - r["p10_us"]) / 1e3 for r in rs], [(r["p90_us"] - r["median_us"]) / 1e3 for r in rs]]
        ax.errorbar([j + 0.1 * (2 * i - 1) for j in range(len(ts))], med, yerr=err, marker="o", capsize=3, ls="",
                    label=f"{label} (median, p10-p90)")
    first = records[0]
    ax.set_title(f"decode step, {first['layers']} layers, H = {first['H']}: CPU eager wall clock — {where}\n"
                 "Python dispatch dominates: not a measurement of the fold", fontsize=9)
    ax.set_xticks(range(len(ts)), [str(t) for t in ts])
    ax.set_xlim(-0.6, len(ts) - 0.4)
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("ms per decode step")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot(records: list[dict], path: str, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if records[0]["device"] == "cuda":
        from attnres.bench.plots import chain_figure

        fig = chain_figure(plt, records, where)
    else:
        fig = cpu_figure(plt, records, where)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    device = pick_device(args.device)
    if device == "cuda" and pick_device("auto") != "cuda":
        print("demo: --device cuda needs attnres built with CUDA and a Hopper GPU", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail before the run, not after it)
        except ImportError:
            print("demo: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    if device == "cpu":
        torch.set_num_threads(1)  # tiny ops: intra-op threads cost more in spin-waits than they save
    tokens = args.tokens or ((1, 8) if device == "cuda" else (4,))
    config = demo_config(device, real=args.real, hidden=args.hidden, layers=args.layers, block=args.block,
                         seed=args.seed)
    where = "CPU reference backend" if device == "cpu" else attnres.backend_info()["cuda_devices"][0]["name"]
    print(f"attnres {attnres.__version__} demo: Kimi K3 decode step, MoE-tail fold off vs on")
    print(f"  device {device} ({where}); H = {config.hidden_size}, {config.num_layers} layers, snapshot block "
          f"{config.snapshot_block} (N <= {config.output_candidates}), T = {', '.join(map(str, tokens))}, "
          f"pdl {not args.no_pdl}; library defaults (the KIMI_K3_* knobs are not read)")
    t0 = time.perf_counter()
    records = run(config, tokens, device=device, repeats=args.repeats, pdl=not args.no_pdl, seed=args.seed)
    lines, ok = report(records, config, device)
    print("\n".join(lines))
    print(f"\n  ({time.perf_counter() - t0:.1f} s)")
    if args.plot:
        plot(records, args.plot, f"{where}, attnres {attnres.__version__}")
        print(f"  plot: {args.plot}")
    return 0 if ok else 1
