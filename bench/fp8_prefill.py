"""The FP8 epilogue at prefill sizes (python -m bench fp8 --prefill): the normed ops (attn_res_rmsnorm, one
addend, two) with fp8 = per_token / block128 against the same call in bf16, under the default options, at
T in {1024, 4096} x N in {1, 2, 3, 5, 7, 9, 12}, H = 7168, cold L2 (rotating sets past twice the L2,
peers.calls_per_graph calls per CUDA graph), the three variants of a point interleaved. The target: the FP8 call
at most TARGET_FRACTION slower than the bf16 call at every point (it also writes the codes and scales: T * H
bytes and T * H / 128 words more, 3-7 % of what the bf16 op moves at these N). Each point also checks that the
codes and scales equal attnres.fp8.quantize of the call's own bf16 output (`bitwise_equal`) and names the kernel
each variant ran on (the FP8 call takes the bf16 call's kernel wherever that kernel has an FP8 instance).
--quick: T = 4096 x N = 2, 6, 9."""

from __future__ import annotations

import torch

import attnres
from attnres import fp8 as _fp8
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import EPS, make_sets

from .grid import measure
from .peers import calls_per_graph
from .prefill import op_bytes, plan

H_DEFAULT = 7168
OPS = ("norm", "add", "add2")
TOKENS = (1024, 4096)
CANDIDATES = (1, 2, 3, 5, 7, 9, 12)
QUICK_POINTS = tuple(("add", 4096, N) for N in (2, 6, 9))
MODES = _fp8.MODES
TARGET_FRACTION = 0.03


def points(quick: bool = False) -> list[tuple[str, int, int]]:
    if quick:
        return list(QUICK_POINTS)
    return [(op, T, N) for op in OPS for N in CANDIDATES for T in TOKENS]


def provider(mode: str | None) -> str:
    return "attnres/bf16" if mode is None else f"attnres/fp8_{mode}"


def _call(op: str, s, mode: str | None):
    w = (s.res_weight, s.rms_weight, s.norm_weight, EPS, EPS)
    if op == "norm":
        return lambda: attnres.attn_res_rmsnorm(s.prefix, s.bank, *w, fp8=mode)
    add2 = s.shared if op == "add2" else None
    return lambda: attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *w, layer_residual_add2=add2, fp8=mode)


def _bf16_output(op: str, s) -> torch.Tensor:
    bf16 = _call(op, s, None)()
    return bf16 if op == "norm" else bf16[1]  # attn_res_rmsnorm: the output; else (updated, output)


def _bitwise_ok(op: str, s, mode: str, bf16_output: torch.Tensor) -> bool:
    """The FP8 call's codes and scales = quantize of its output, and its output = the bf16 call's."""
    output, codes, scales = _call(op, s, mode)()[-3:]
    ref_codes, ref_scales = _fp8.quantize(output, mode, False)
    return (torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
            and torch.equal(scales.contiguous().view(torch.int32), ref_scales.view(torch.int32))
            and torch.equal(output.view(torch.int16), bf16_output.view(torch.int16)))


def run_point(op: str, T: int, N: int, H: int, repeats: int) -> list[dict]:
    nbytes = op_bytes(op, T, N, H) + T * H + T * (H // _fp8.GROUP) * 4
    count = rotating_sets(nbytes, minimum=1)
    sets = make_sets(T, N, H, count, seed=T * 100 + N + 11 * OPS.index(op))
    calls = calls_per_graph(count, nbytes)
    modes = (None, *MODES)
    graphs = {provider(m): (capture([_call(op, sets[i % count], m) for i in range(calls)]), calls) for m in modes}
    timings = time_interleaved(graphs, repeats=repeats)
    bf16_output = _bf16_output(op, sets[0])
    records = []
    for m in modes:
        p = plan(op, T, N, H, fp8=m)
        records.append({"suite": "fp8_prefill", "provider": provider(m), "op": op, "mode": m, "T": T, "N": N,
                        "H": H, "sets": count, "kernel": p.kernel, "route": p.route,
                        "bitwise_equal": None if m is None else _bitwise_ok(op, sets[0], m, bf16_output),
                        **timings[provider(m)].as_dict()})
    del graphs, sets
    torch.cuda.empty_cache()
    return records


def run(quick: bool = False, H: int = H_DEFAULT, progress=None, repeats: int = 25) -> list[dict]:
    return measure(points(quick), lambda op, T, N: run_point(op, T, N, H, repeats),
                   lambda op, T, N: f"fp8 prefill {op} T={T} N={N}", progress)


# ------------------------------------------------------------------------------------------- reading records
def table(records: list[dict]) -> list[dict]:
    """Per (op, T, N, mode): the bf16 and FP8 medians, the cost as a fraction of the bf16 call, both kernels."""
    cell = {(r["op"], r["T"], r["N"], r["mode"]): r for r in records
            if r.get("suite") == "fp8_prefill" and "median_us" in r}
    rows = []
    for (op, T, N, mode), r in sorted(cell.items(), key=lambda kv: (OPS.index(kv[0][0]), kv[0][1], kv[0][2],
                                                                     str(kv[0][3]))):
        base = cell.get((op, T, N, None))
        if mode is None or base is None:
            continue
        rows.append({"op": op, "T": T, "N": N, "mode": mode, "bf16_us": base["median_us"], "fp8_us": r["median_us"],
                     "cost": r["median_us"] / base["median_us"] - 1.0, "bf16_kernel": base["kernel"],
                     "fp8_kernel": r["kernel"], "bitwise_equal": r["bitwise_equal"]})
    return rows


def differing(records: list[dict]) -> list[tuple]:
    """(op, T, N, mode) of every point whose codes or scales differ from the reference quantization."""
    return sorted((r["op"], r["T"], r["N"], r["mode"]) for r in records
                  if r.get("suite") == "fp8_prefill" and r.get("bitwise_equal") is False)


def target(records: list[dict]) -> tuple[str, str, str, bool] | None:
    rows = table(records)
    if not rows:
        return None
    worst = max(rows, key=lambda r: r["cost"])
    over = [r for r in rows if r["cost"] > TARGET_FRACTION]
    bad = differing(records)
    measured = (f"{len(rows) - len(over)} of {len(rows)} points; worst {100 * worst['cost']:+.1f}% at {worst['op']} "
                f"T={worst['T']} N={worst['N']} {worst['mode']} ({worst['fp8_kernel']} vs {worst['bf16_kernel']})"
                + ("" if not bad else f"; NOT bitwise equal at {bad}"))
    return ("fp8 prefill", f"the FP8 epilogue costs <= {100 * TARGET_FRACTION:.0f}% over the bf16 call, T >= 1024",
            measured, not over and not bad)


def summary(records: list[dict]) -> list[str]:
    rows = table(records)
    if not rows:
        return []
    lines = [f"fp8 prefill (default options, cold L2, H = {records[0]['H']}): op T N mode, bf16 and FP8 µs, the "
             "cost, the kernels"]
    for r in rows:
        kernels = r["bf16_kernel"] if r["bf16_kernel"] == r["fp8_kernel"] else f"{r['bf16_kernel']} -> {r['fp8_kernel']}"
        lines.append(f"  {r['op']:<5} {r['T']:>5} {r['N']:>3} {r['mode']:<9} {r['bf16_us']:8.1f} {r['fp8_us']:8.1f} "
                     f"{100 * r['cost']:+6.1f}%  {kernels}")
    what = target(records)
    lines.append(f"target: {what[1]}: {what[2]} -> {'met' if what[3] else 'MISSED'}")
    return lines
