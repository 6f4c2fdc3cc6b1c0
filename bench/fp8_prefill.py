"""The FP8 epilogue at prefill sizes (python -m bench fp8 --prefill): the normed ops (attn_res_rmsnorm, one
addend, two) with fp8 = per_token / block128, with the bf16 output (the call writes both) and without it
(fp8_only: the codes and scales replace it), against the same call in bf16, under the default options, at
T in {1024, 4096} x N in {1, 2, 3, 5, 7, 9, 12}, H = 7168, cold L2 (rotating sets past twice the L2,
peers.calls_per_graph calls per CUDA graph), the five variants of a point interleaved. The target: the FP8-only
call at most TARGET_FRACTION slower than the bf16 call at every point (it writes T * H bytes of codes and
T * H / 128 words of scales in place of the T * H bf16 output's 2 T * H bytes); the call that writes both moves
T * H bytes and T * H / 128 words more than the bf16 call (3-26 % of its bytes at these N), reported beside. Each
point also checks that the codes and scales equal attnres.fp8.quantize of the bf16 call's output
(`bitwise_equal`) and names the kernel each variant ran on (the FP8 call takes the bf16 call's kernel wherever
that kernel has an FP8 instance). --quick: T = 4096 x N = 2, 6, 9."""

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
# (mode, fp8_only) of a point's variants: the bf16 call, then the FP8 calls with and without the bf16 output.
VARIANTS = ((None, False), *((m, False) for m in MODES), *((m, True) for m in MODES))
TARGET_FRACTION = 0.03


def points(quick: bool = False) -> list[tuple[str, int, int]]:
    if quick:
        return list(QUICK_POINTS)
    return [(op, T, N) for op in OPS for N in CANDIDATES for T in TOKENS]


def provider(mode: str | None, fp8_only: bool = False) -> str:
    if mode is None:
        return "attnres/bf16"
    return f"attnres/fp8_only_{mode}" if fp8_only else f"attnres/fp8_{mode}"


def _call(op: str, s, mode: str | None, fp8_only: bool = False):
    w = (s.res_weight, s.rms_weight, s.norm_weight, EPS, EPS)
    kw = {"fp8": mode, "fp8_only": fp8_only}
    if op == "norm":
        return lambda: attnres.attn_res_rmsnorm(s.prefix, s.bank, *w, **kw)
    add2 = s.shared if op == "add2" else None
    return lambda: attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *w, layer_residual_add2=add2, **kw)


def _bf16_output(op: str, s) -> torch.Tensor:
    bf16 = _call(op, s, None)()
    return bf16 if op == "norm" else bf16[1]  # attn_res_rmsnorm: the output; else (updated, output)


def _bitwise_ok(op: str, s, mode: str, fp8_only: bool, bf16_output: torch.Tensor) -> bool:
    """The FP8 call's codes and scales = quantize of the bf16 call's output, and its own output (where it writes
    one) = the bf16 call's."""
    result = _call(op, s, mode, fp8_only)()
    codes, scales = result[-2:]
    ref_codes, ref_scales = _fp8.quantize(bf16_output, mode, False)
    return (torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
            and torch.equal(scales.contiguous().view(torch.int32), ref_scales.view(torch.int32))
            and (fp8_only or torch.equal(result[-3].view(torch.int16), bf16_output.view(torch.int16))))


def run_point(op: str, T: int, N: int, H: int, repeats: int) -> list[dict]:
    nbytes = op_bytes(op, T, N, H) + T * H + T * (H // _fp8.GROUP) * 4
    count = rotating_sets(nbytes, minimum=1)
    sets = make_sets(T, N, H, count, seed=T * 100 + N + 11 * OPS.index(op))
    calls = calls_per_graph(count, nbytes)
    graphs = {provider(m, only): (capture([_call(op, sets[i % count], m, only) for i in range(calls)]), calls)
              for m, only in VARIANTS}
    timings = time_interleaved(graphs, repeats=repeats)
    bf16_output = _bf16_output(op, sets[0])
    records = []
    for m, only in VARIANTS:
        p = plan(op, T, N, H, fp8=m)
        records.append({"suite": "fp8_prefill", "provider": provider(m, only), "op": op, "mode": m,
                        "fp8_only": only, "T": T, "N": N, "H": H, "sets": count, "kernel": p.kernel,
                        "route": p.route,
                        "bitwise_equal": None if m is None else _bitwise_ok(op, sets[0], m, only, bf16_output),
                        **timings[provider(m, only)].as_dict()})
    del graphs, sets
    torch.cuda.empty_cache()
    return records


def run(quick: bool = False, H: int = H_DEFAULT, progress=None, repeats: int = 25) -> list[dict]:
    return measure(points(quick), lambda op, T, N: run_point(op, T, N, H, repeats),
                   lambda op, T, N: f"fp8 prefill {op} T={T} N={N}", progress)


# ------------------------------------------------------------------------------------------- reading records
def table(records: list[dict]) -> list[dict]:
    """Per (op, T, N, mode, fp8_only): the bf16 and FP8 medians, the cost as a fraction of the bf16 call, both
    kernels."""
    cell = {(r["op"], r["T"], r["N"], r["mode"], bool(r.get("fp8_only"))): r for r in records
            if r.get("suite") == "fp8_prefill" and "median_us" in r}
    rows = []
    for (op, T, N, mode, only), r in sorted(cell.items(), key=lambda kv: (OPS.index(kv[0][0]), kv[0][1], kv[0][2],
                                                                           kv[0][4], str(kv[0][3]))):
        base = cell.get((op, T, N, None, False))
        if mode is None or base is None:
            continue
        rows.append({"op": op, "T": T, "N": N, "mode": mode, "fp8_only": only, "bf16_us": base["median_us"],
                     "fp8_us": r["median_us"], "cost": r["median_us"] / base["median_us"] - 1.0,
                     "bf16_kernel": base["kernel"], "fp8_kernel": r["kernel"], "bitwise_equal": r["bitwise_equal"]})
    return rows


def differing(records: list[dict]) -> list[tuple]:
    """(op, T, N, mode, fp8_only) of every point whose codes or scales differ from the reference quantization."""
    return sorted((r["op"], r["T"], r["N"], r["mode"], bool(r.get("fp8_only"))) for r in records
                  if r.get("suite") == "fp8_prefill" and r.get("bitwise_equal") is False)


def _worst(rows: list[dict]) -> str:
    worst = max(rows, key=lambda r: r["cost"])
    over = [r for r in rows if r["cost"] > TARGET_FRACTION]
    return (f"{len(rows) - len(over)} of {len(rows)} points; worst {100 * worst['cost']:+.1f}% at {worst['op']} "
            f"T={worst['T']} N={worst['N']} {worst['mode']} ({worst['fp8_kernel']} vs {worst['bf16_kernel']})")


def target(records: list[dict]) -> tuple[str, str, str, bool] | None:
    """The FP8-only calls against TARGET_FRACTION (records without them: the calls that write both outputs)."""
    rows = table(records)
    if not rows:
        return None
    only = [r for r in rows if r["fp8_only"]]
    judged = only or rows
    bad = differing(records)
    measured = _worst(judged) + ("" if not bad else f"; NOT bitwise equal at {bad}")
    what = "the FP8-only call" if only else "the FP8 call (bf16 output too)"
    return ("fp8 prefill", f"{what} costs <= {100 * TARGET_FRACTION:.0f}% over the bf16 call, T >= 1024",
            measured, all(r["cost"] <= TARGET_FRACTION for r in judged) and not bad)


def summary(records: list[dict]) -> list[str]:
    rows = table(records)
    if not rows:
        return []
    lines = [f"fp8 prefill (default options, cold L2, H = {records[0]['H']}): op T N mode, bf16 and FP8 µs, the "
             "cost, the kernels"]
    for r in rows:
        kernels = r["bf16_kernel"] if r["bf16_kernel"] == r["fp8_kernel"] else f"{r['bf16_kernel']} -> {r['fp8_kernel']}"
        mode = ("only " if r["fp8_only"] else "") + r["mode"]
        lines.append(f"  {r['op']:<5} {r['T']:>5} {r['N']:>3} {mode:<14} {r['bf16_us']:8.1f} {r['fp8_us']:8.1f} "
                     f"{100 * r['cost']:+6.1f}%  {kernels}")
    both = [r for r in rows if not r["fp8_only"]]
    if both and len(both) < len(rows):
        lines.append(f"the FP8 call with the bf16 output too: {_worst(both)}")
    what = target(records)
    lines.append(f"target: {what[1]}: {what[2]} -> {'met' if what[3] else 'MISSED'}")
    return lines
