"""The decode chain's figure (matplotlib): step time with the MoE-tail fold off and on vs T, and the saving per MoE
layer, drawn from the chain suite's records (`python -m attnres demo --plot`); and the series helper it draws
with. Runs anywhere (no GPU): it only reads records."""

from __future__ import annotations

from collections import defaultdict


def plot_series(ax, series, xlabel, title, floor=None):
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


def chain_figure(plt, records: list[dict], where: str):
    """The decode chain's figure: step time with the fold off and on vs T (left), the saving per MoE layer
    (right). `where` names the run (GPU and commit) in the title. Used by `attnres demo --plot` (and the
    repository's `python -m bench plot`)."""
    series, saving, first = chain_series(records)
    how = "CUDA-graph replay, one graph per step" if first.get("graph") else "CPU eager, wall clock: not a measurement"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    plot_series(left, series, "T (tokens)", f"decode chain, {first['layers']} layers, H = {first['H']}, sites + "
                                            f"MoE-tail adds only\n{how} — {where}")
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
