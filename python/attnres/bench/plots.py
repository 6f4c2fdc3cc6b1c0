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
        _plot(ax, _decode_series(decode, "N", "T", 1), "N (candidates)",
              f"attn_res_add_rmsnorm step, T = 1, H = 7168 — {tag}", floor)
        save(fig, "us_vs_N_T1.png")
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _plot(ax, _decode_series(decode, "T", "N", 9), "T (tokens)",
              f"attn_res_add_rmsnorm step, N = 9, H = 7168 — {tag}", floor)
        ax.set_xscale("log", base=2)
        save(fig, "us_vs_T_N9.png")

    bandwidth = bandwidth_series(records)
    if bandwidth:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _plot(ax, bandwidth, "T (tokens)", "GB/s over the bytes the op must move, N = 9, H = 7168\n— "
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
        _plot(ax, {k: sorted(v) for k, v in tune.items() if not k.startswith("auto")}, "N (candidates)",
              f"kernel geometry sweep (add2), T = 1, H = 7168 — {_tag(tune_records)}")
        save(fig, "kernel_sweep_T1.png")

    fin = defaultdict(list)
    for r in records:
        if r.get("suite") == "finalize":
            fin[r["provider"]].append((r["T"], r["median_us"], r["p10_us"], r["p90_us"]))
    if fin:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _plot(ax, {k: sorted(v) for k, v in fin.items()}, "T (tokens)",
              f"MoE finalize, k = 16, D = 3584 — {_tag([r for r in records if r.get('suite') == 'finalize'])}")
        ax.set_xscale("log", base=2)
        save(fig, "moe_finalize.png")

    if chain_series(records)[2]:
        save(chain_figure(plt, records, _tag([r for r in records if r.get("suite") == "chain"])), "chain_fold.png")
    return written


def chain_figure(plt, records: list[dict], where: str):
    """The decode chain's figure: step time with the fold off and on vs T (left), the saving per MoE layer
    (right). `where` names the run (GPU and commit) in the title. Used by `bench plot` and `attnres demo --plot`."""
    series, saving, first = chain_series(records)
    how = "CUDA-graph replay, one graph per step" if first.get("graph") else "CPU eager, wall clock: not a measurement"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    _plot(left, series, "T (tokens)", f"decode chain, {first['layers']} layers, H = {first['H']}, sites + MoE-tail "
                                     f"adds only\n{how} — {where}")
    left.set_ylabel("ms per decode step")
    left.set_yscale("linear")
    ts = list(saving)
    # The noise of the difference (the two p10-p90 spreads combined) as the error bar: a saving inside it is not one.
    noise = {r["T"]: r["saving_noise_us"] / max(r["moe_layers"], 1) for r in records
             if r.get("suite") == "chain" and r.get("graph") == first.get("graph")}
    right.errorbar(ts, [saving[t] for t in ts], yerr=[noise.get(t, 0.0) for t in ts], marker="o", ms=3, capsize=2,
                   label="(fold off − fold on) / MoE layers, ± noise of the difference")
    right.axhline(0.0, color="black", lw=0.5)
    if first["layers"] == 93:
        right.axhline(200.0 / first["moe_layers"], color="gray", ls=":",
                      label=f"target: 0.2 ms per step = {200.0 / first['moe_layers']:.2f} µs per MoE layer")
    right.set_ylim(bottom=min(0.0, 1.1 * min(saving[t] - noise.get(t, 0.0) for t in ts)))
    right.set_xlabel("T (tokens)")
    right.set_ylabel("µs saved per MoE layer")
    right.set_title("the fold's saving per MoE layer", fontsize=9)
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts, [str(t) for t in ts])
    return fig
