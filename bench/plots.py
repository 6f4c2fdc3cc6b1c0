"""Plots of results files (matplotlib, PNG; `python -m bench plot`): µs vs N at T = 1 per provider, µs vs T at
N = 9, GB/s vs T, the cluster sweep at H = 7168, the MoE finalize A/B, and the decode chain's step time with the
fold on/off vs T (attnres.bench.plots.chain_figure). Runs anywhere (no GPU): it only reads the JSON."""

from __future__ import annotations

import json
import os
from collections import defaultdict

from attnres.bench.plots import chain_figure, chain_series, plot_series


def _decode_series(records, key, fixed, fixed_value):
    series = defaultdict(list)
    for r in records:
        if r.get("suite") == "decode" and r[fixed] == fixed_value:
            series[r["provider"]].append((r[key], r["median_us"], r["p10_us"], r["p90_us"]))
    return {p: sorted(v) for p, v in series.items()}


def _load(results_paths: list[str]) -> tuple[list[dict], dict, dict]:
    """Records of every file, each tagged with its file's meta under "_meta" (files of different commits and
    machines may be combined: every figure names the run its points come from), the first file's meta, and the
    floors of the files that measured them (launch floor, copy bandwidth)."""
    records, floors, first_meta = [], {}, None
    for path in results_paths:
        data = json.load(open(path))
        first_meta = first_meta or data["meta"]
        for key, value in data.get("floors", {}).items():
            floors.setdefault(key, value)
        records += [{**r, "_meta": data["meta"]} for r in data["records"]]
    return records, first_meta or {}, floors


def _tag(records: list[dict]) -> str:
    runs = sorted({(r["_meta"].get("gpu") or "CPU", r["_meta"]["commit"]) for r in records})
    return "; ".join(f"{gpu}, commit {commit}" for gpu, commit in runs)


def bandwidth_series(records) -> dict:
    """GB/s over the bytes each op must move vs T at N = 9, H = 7168: the per-token kernels from the decode
    sweep, the persistent suite's providers (with and without the addend) where it ran."""
    series = defaultdict(list)
    for r in records:
        if r.get("suite") == "decode" and r["N"] == 9 and r["provider"].startswith("attnres/") and r.get("bytes"):
            series[f"{r['provider']} (decode sweep)"].append((r["T"], r["bytes"] / (r["median_us"] * 1e-6) / 1e9,
                                                               r["bytes"] / (r["p90_us"] * 1e-6) / 1e9,
                                                               r["bytes"] / (r["p10_us"] * 1e-6) / 1e9))
        if r.get("suite") == "persistent" and r["N"] == 9 and r.get("gbps"):
            name = f"{r['provider']} ({'add' if r.get('add') else 'no add'})"
            series[name].append((r["T"], r["gbps"], r["bytes"] / (r["p90_us"] * 1e-6) / 1e9,
                                 r["bytes"] / (r["p10_us"] * 1e-6) / 1e9))
    return {k: sorted(v) for k, v in series.items()}


def make_plots(results_paths: list[str] | str, out_dir: str) -> list[str]:
    """Draws every figure whose suite is in the given results files (a figure without points is not drawn, so
    plotting one suite's file leaves the others' PNGs alone)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(results_paths, str):
        results_paths = [results_paths]
    records, _, floors = _load(results_paths)
    floor = floors.get("launch", {}).get("median_us")
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(fig, name):
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    decode = [r for r in records if r.get("suite") == "decode"]
    if decode:
        tag = _tag(decode)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        plot_series(ax, _decode_series(decode, "N", "T", 1), "N (candidates)",
                    f"attn_res_add_rmsnorm step, T = 1, H = 7168 — {tag}", floor)
        save(fig, "us_vs_N_T1.png")
        fig, ax = plt.subplots(figsize=(7, 4.5))
        plot_series(ax, _decode_series(decode, "T", "N", 9), "T (tokens)",
                    f"attn_res_add_rmsnorm step, N = 9, H = 7168 — {tag}", floor)
        ax.set_xscale("log", base=2)
        save(fig, "us_vs_T_N9.png")

    bandwidth = bandwidth_series(records)
    if bandwidth:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        plot_series(ax, bandwidth, "T (tokens)", "GB/s over the bytes the op must move, N = 9, H = 7168\n— "
                    + _tag([r for r in records if r.get("suite") in ("decode", "persistent")]))
        ax.set_ylabel("GB/s")
        ax.set_xscale("log", base=2)
        copy_tbs = floors.get("copy_tbs")
        if copy_tbs:
            ax.axhline(copy_tbs * 1000, color="gray", ls="--", label=f"measured copy bandwidth {copy_tbs:.2f} TB/s")
            ax.axhline(0.85 * copy_tbs * 1000, color="gray", ls=":", label="target: 85% of it")
            ax.legend(fontsize=7)
        save(fig, "gbps_vs_T_N9.png")

    tune = defaultdict(list)
    tune_records = [r for r in records if r.get("suite") == "tune"]
    for r in tune_records:
        if r.get("suite") == "tune" and r["H"] == 7168 and r["T"] == 1:
            tune[r["provider"]].append((r["N"], r["median_us"], r["p10_us"], r["p90_us"]))
    if tune:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        plot_series(ax, {k: sorted(v) for k, v in tune.items() if not k.startswith("auto")}, "N (candidates)",
                    f"kernel geometry sweep (add2), T = 1, H = 7168 — {_tag(tune_records)}")
        save(fig, "kernel_sweep_T1.png")

    fin = defaultdict(list)
    for r in records:
        if r.get("suite") == "finalize":
            fin[r["provider"]].append((r["T"], r["median_us"], r["p10_us"], r["p90_us"]))
    if fin:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        plot_series(ax, {k: sorted(v) for k, v in fin.items()}, "T (tokens)",
                    f"MoE finalize, k = 16, D = 3584 — {_tag([r for r in records if r.get('suite') == 'finalize'])}")
        ax.set_xscale("log", base=2)
        save(fig, "moe_finalize.png")

    if chain_series(records)[2]:
        save(chain_figure(plt, records, _tag([r for r in records if r.get("suite") == "chain"])), "chain_fold.png")
    return written
