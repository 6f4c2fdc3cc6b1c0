"""Plots of a results file (matplotlib, PNG): µs vs N at T = 1 per provider, µs vs T at N = 9, the cluster
sweep at H = 7168, and the MoE finalize A/B. Runs anywhere (no GPU): it only reads the JSON."""

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
    return written
