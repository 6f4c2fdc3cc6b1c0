"""Plots of a results file (matplotlib, PNG): µs vs N at T = 1 per provider, µs vs T at N = 9, the cluster
sweep at H = 7168, the MoE finalize A/B, and the decode chain's step time with the fold on/off vs T. Runs
anywhere (no GPU): it only reads the JSON."""

from __future__ import annotations

import json
import os
from collections import defaultdict


def _decode_series(records, key, fixed, fixed_value):
    series = defaultdict(list)
    for r in records:
        if r.get("suite") == "decode" and r[fixed] == fixed_value:
            series[r["provider"]].append((r[key], r["median_us"], r["p10_us"], r["p90_us"]))
    return {p: sorted(v) for p, v in series.items()}


def _plot(ax, series, xlabel, title, floor=None):
    for name, pts in sorted(series.items()):
        xs = [p[0] for p in pts]
        ax.errorbar(xs, [p[1] for p in pts], yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                    marker="o", ms=3, capsize=2, label=name)
    if floor:
        ax.axhline(floor, color="gray", ls=":", label="launch floor (1 tiny kernel per graph node)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("µs per call (CUDA-graph replay, cold L2)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def chain_series(records) -> tuple[dict, dict, dict | None]:
    """The chain suite's points: ({provider: [(T, median, p10, p90)]} in ms, {T: saving per MoE layer in µs}, a
    record describing the run (None without chain records). Graph-replayed records when there are any, else
    the CPU ones (wall clock)."""
    chain = [r for r in records if r.get("suite") == "chain"]
    if any(r.get("graph") for r in chain):
        chain = [r for r in chain if r.get("graph")]
    series, saving = defaultdict(list), {}
    for r in chain:
        series[r["provider"]].append((r["T"], r["median_us"] / 1e3, r["p10_us"] / 1e3, r["p90_us"] / 1e3))
        saving[r["T"]] = r["saving_per_moe_layer_us"]
    return {p: sorted(v) for p, v in series.items()}, dict(sorted(saving.items())), (chain[0] if chain else None)


def make_plots(results_path: str, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(results_path))
    meta, records = data["meta"], data["records"]
    floor = data.get("floors", {}).get("launch", {}).get("median_us")
    tag = f"{meta['gpu']}, commit {meta['commit']}"
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(fig, name):
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    _plot(ax, _decode_series(records, "N", "T", 1), "N (candidates)", f"attn_res_add_rmsnorm step, T = 1, H = 7168 — {tag}", floor)
    save(fig, "us_vs_N_T1.png")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _plot(ax, _decode_series(records, "T", "N", 9), "T (tokens)", f"attn_res_add_rmsnorm step, N = 9, H = 7168 — {tag}", floor)
    ax.set_xscale("log", base=2)
    save(fig, "us_vs_T_N9.png")

    tune = defaultdict(list)
    for r in records:
        if r.get("suite") == "tune" and r["H"] == 7168 and r["T"] == 1:
            tune[r["provider"]].append((r["N"], r["median_us"], r["p10_us"], r["p90_us"]))
    if tune:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _plot(ax, {k: sorted(v) for k, v in tune.items() if not k.startswith("auto")}, "N (candidates)",
              f"kernel geometry sweep (add2), T = 1, H = 7168 — {tag}")
        save(fig, "kernel_sweep_T1.png")

    fin = defaultdict(list)
    for r in records:
        if r.get("suite") == "finalize":
            fin[r["provider"]].append((r["T"], r["median_us"], r["p10_us"], r["p90_us"]))
    if fin:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _plot(ax, {k: sorted(v) for k, v in fin.items()}, "T (tokens)", f"MoE finalize, k = 16, D = 3584 — {tag}")
        ax.set_xscale("log", base=2)
        save(fig, "moe_finalize.png")

    series, saving, first = chain_series(records)
    if first:
        how = ("CUDA-graph replay, one graph per step" if first.get("graph")
               else "CPU eager, wall clock: not a measurement")
        where = f"{meta.get('gpu') or 'CPU'}, commit {meta['commit']}"
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
        _plot(left, series, "T (tokens)", f"decode chain, {first['layers']} layers, H = {first['H']}, sites + MoE-tail "
                                         f"adds only\n{how} — {where}")
        left.set_ylabel("ms per decode step")
        left.set_yscale("linear")
        ts = list(saving)
        right.plot(ts, [saving[t] for t in ts], marker="o", ms=3, label="(fold off − fold on) / MoE layers")
        if first["layers"] == 93:
            right.axhline(200.0 / first["moe_layers"], color="gray", ls=":",
                          label=f"P6: 0.2 ms per step = {200.0 / first['moe_layers']:.2f} µs per MoE layer")
        right.set_ylim(bottom=min(0.0, 1.1 * min(saving.values())))
        right.set_xlabel("T (tokens)")
        right.set_ylabel("µs saved per MoE layer")
        right.set_title("the fold's saving per MoE layer", fontsize=9)
        right.grid(True, which="both", alpha=0.3)
        right.legend(fontsize=7)
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ts, [str(t) for t in ts])
        save(fig, "chain_fold.png")
    return written
