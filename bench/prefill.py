"""The prefill grid (python -m bench prefill): every attention op under the default options (what a user gets) at
T in {1024, 4096, 16384} x N = 1..16, H = 7168, cold L2 (rotating sets past twice the L2, peers.calls_per_graph
calls per CUDA graph), against the copy rate of the same run (floors.copy_bandwidth_tbs).

The ops, by the bytes they must move per token (`op_bytes`):
  mix   attn_res without an addend or the fp32 diagnostics (the engines' mixture): N rows read, one written;
  norm  attn_res_rmsnorm: N rows read, the output written (N = 1: an RMSNorm of the prefix);
  add   attn_res_add_rmsnorm with one addend: N + 1 rows read, `updated` and the output written;
  add2  attn_res_add_rmsnorm with two addends (the MoE tail's fold): N + 2 read, two written.

The target (docs/performance.md): the default at >= 90 % of the copy rate at every point. Each point also times,
interleaved with it, the same number of elementwise copies of the point's bytes (`torch.mul(src, 1, out=dst)`,
the kernel floors.copy_bandwidth_tbs times, without PDL) over as many buffer pairs: `copy_same_us` and
`pct_copy_same` (the copy's time over the op's) say what of a short point's distance from the copy rate a plain copy
of the same size pays too (a call's launch, ramp and tail). --quick: T = 4096 x
N = 1, 2, 5, 9, 12, 16; --tokens, --candidates and --ops choose other points. --forced also times, interleaved with the
default, every kernel the call can run on when forced (peers.FORCED): where the default misses the target, whether
another kernel would not."""

from __future__ import annotations

import torch

import attnres
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import EPS, make_sets

from .grid import copy_rate, measure
from .peers import FORCED, call, calls_per_graph, op_name

H_DEFAULT = 7168
OPS = ("mix", "norm", "add", "add2")
TOKENS = (1024, 4096, 16384)
CANDIDATES = tuple(range(1, 17))
QUICK_TOKENS = (4096,)
QUICK_CANDIDATES = (1, 2, 5, 9, 12, 16)
TARGET_FRACTION = 0.90


def function_name(op: str) -> str:
    """The op's function: attn_res, attn_res_rmsnorm or attn_res_add_rmsnorm."""
    return op_name(addends(op) >= 1, op == "mix")


def addends(op: str) -> int:
    return {"mix": 0, "norm": 0, "add": 1, "add2": 2}[op]


def op_bytes(op: str, T: int, N: int, H: int) -> int:
    """Reads of N - 1 bank rows, the prefix and the addends per token; writes of the output and (with an addend)
    `updated` per token; the weight rows once (res and rms; norm too for the normed ops)."""
    row, a = 2 * H, addends(op)
    return T * row * (N + a) + T * row * (1 + (1 if a else 0)) + (2 if op == "mix" else 3) * row


def points(quick: bool = False, tokens=None, candidates=None, ops=None) -> list[tuple[str, int, int]]:
    """ops: a subset of OPS (default: all of them)."""
    tokens = tokens or (QUICK_TOKENS if quick else TOKENS)
    candidates = candidates or (QUICK_CANDIDATES if quick else CANDIDATES)
    return [(op, T, N) for op in (ops or OPS) for N in candidates for T in tokens]


def plan(op: str, T: int, N: int, H: int, device="cuda", options: attnres.Options | None = None,
         fp8: str | None = None):
    """The plan of the point's call under `options` (default: the default options), with the FP8 epilogue `fp8`."""
    a = addends(op)
    return attnres.plan(function_name(op), tokens=T, candidates=N, hidden=H, device=device, add=a >= 1,
                        add2=a == 2, fp8=fp8, options=options or attnres.Options())


def providers(op: str, T: int, N: int, H: int, forced: bool, device="cuda") -> dict[str, attnres.Options]:
    """attnres/default, and with `forced` every kernel the plan runs the call on when forced."""
    out = {"attnres/default": attnres.Options()}
    for name, kw in (FORCED.items() if forced else ()):
        if plan(op, T, N, H, device, attnres.Options(**kw)).accepted:
            out[f"attnres/{name}"] = attnres.Options(**kw)
    return out


def _call(op: str, s, o: attnres.Options):
    """The point's call: the peers' calls of attn_res (no diagnostics), attn_res_rmsnorm and one addend; add2 here."""
    if op != "add2":
        return call(s, o, add=op == "add", mix=op == "mix")
    w = (s.res_weight, s.rms_weight, s.norm_weight, EPS, EPS)
    return lambda: attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *w, layer_residual_add2=s.shared,
                                                options=o)


SAME_BYTES_COPY = "copy/same_bytes"


def _copy_pairs(nbytes: int, count: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (source, destination) buffers whose copy moves `nbytes` (nbytes / 2 read, nbytes / 2 written). The
    caller keeps them alive while a graph of their copies exists (a graph holds no reference to them)."""
    n = max(nbytes // 4, 1)  # bf16 elements per buffer
    return [(torch.ones(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device))
            for _ in range(count)]


def run_point(op: str, T: int, N: int, H: int, copy_tbs: float, repeats: int, forced: bool = False) -> list[dict]:
    nbytes = op_bytes(op, T, N, H)
    count = rotating_sets(nbytes, minimum=1)
    sets = make_sets(T, N, H, count, seed=T * 100 + N + 7 * OPS.index(op))
    calls = calls_per_graph(count, nbytes)
    opts = providers(op, T, N, H, forced)
    graphs = {name: (capture([_call(op, sets[i % count], o) for i in range(calls)]), calls)
              for name, o in opts.items()}
    pairs = _copy_pairs(nbytes, count, sets[0].prefix.device)
    graphs[SAME_BYTES_COPY] = (capture([lambda p=pairs[i % count]: torch.mul(p[0], 1, out=p[1])
                                        for i in range(calls)]), calls)
    timings = time_interleaved(graphs, repeats=repeats)
    copy_same_us = timings.pop(SAME_BYTES_COPY).median_us
    records = []
    for name, t in timings.items():
        p = plan(op, T, N, H, options=opts[name])
        gbps = nbytes / (t.median_us * 1e-6) / 1e9
        records.append({"suite": "prefill", "provider": name, "op": op, "T": T, "N": N, "H": H, "sets": count,
                        "bytes": nbytes, "gbps": gbps, "copy_tbs": copy_tbs,
                        "pct_copy": 100.0 * gbps / (copy_tbs * 1000.0), "copy_same_us": copy_same_us,
                        "pct_copy_same": 100.0 * copy_same_us / t.median_us, "kernel": p.kernel, "route": p.route,
                        **t.as_dict()})
    del graphs, sets, pairs
    torch.cuda.empty_cache()
    return records


def run(quick: bool = False, H: int = H_DEFAULT, copy_tbs: float | None = None, progress=None, repeats: int = 25,
        tokens=None, candidates=None, forced: bool = False, ops=None) -> list[dict]:
    copy_tbs = copy_rate(copy_tbs)
    return measure(points(quick, tokens, candidates, ops),
                   lambda op, T, N: run_point(op, T, N, H, copy_tbs, repeats, forced),
                   lambda op, T, N: f"prefill {op} T={T} N={N}", progress)


# ------------------------------------------------------------------------------------------- reading records
def _records(records, provider: str | None = "attnres/default"):
    """The suite's records (of one provider; None: every provider)."""
    return [r for r in records if r.get("suite") == "prefill" and (provider is None or r["provider"] == provider)]


def target(records: list[dict]) -> tuple[str, str, str, bool] | None:
    """The default at >= TARGET_FRACTION of the run's copy rate at every point from T = 1024 on."""
    rec = [r for r in _records(records) if r["T"] >= 1024]
    if not rec:
        return None
    worst = min(rec, key=lambda r: r["pct_copy"])
    short = [r for r in rec if r["pct_copy"] < 100 * TARGET_FRACTION]
    measured = (f"{len(rec) - len(short)} of {len(rec)} points; lowest {worst['pct_copy']:.1f}% at {worst['op']} "
                f"T={worst['T']} N={worst['N']} ({worst['kernel']}, {worst['median_us']:.1f} us)")
    same = [r for r in rec if "pct_copy_same" in r]
    if same:
        below = [r for r in same if r["pct_copy_same"] < 100 * TARGET_FRACTION]
        low = min(same, key=lambda r: r["pct_copy_same"])
        measured += (f"; against a copy of the same bytes: {len(same) - len(below)} of {len(same)}, lowest "
                     f"{low['pct_copy_same']:.1f}% at {low['op']} T={low['T']} N={low['N']}")
    return ("prefill", f"the default at >= {100 * TARGET_FRACTION:.0f}% of the copy rate, T >= 1024, every op and N",
            measured, not short)


def forced(records: list[dict]) -> dict[tuple[str, int, int], dict[str, dict]]:
    """(op, T, N) -> {forced kernel: its record} (runs with --forced)."""
    out: dict[tuple[str, int, int], dict[str, dict]] = {}
    for r in _records(records, None):
        if r["provider"] != "attnres/default":
            out.setdefault((r["op"], r["T"], r["N"]), {})[r["provider"].split("/")[1]] = r
    return out


def fastest_forced(records: list[dict]) -> dict[tuple[str, int, int], dict]:
    """(op, T, N) -> the record of the fastest forced kernel at the point (runs with --forced)."""
    return {key: min(by_kernel.values(), key=lambda r: r["median_us"]) for key, by_kernel in forced(records).items()}


# The margin of the automatic topology's two-addend rows (tuning::automatic_persistent_min_tokens): the persistent
# kernel is taken where it ran at least 3 % faster than every other kernel, beyond the harness's resolution.
PERSISTENT_MARGIN = 0.97


def persistent_from(records: list[dict], op: str) -> dict[int, int | None]:
    """N -> the smallest measured T from which the forced persistent kernel ran at most PERSISTENT_MARGIN times the
    fastest other forced kernel at that T and at every larger measured T (None: at no T), for the N of `op` that
    --forced measured with the persistent kernel: the rule the two-addend rows of the automatic topology's table
    were taken by."""
    ratio: dict[tuple[int, int], float] = {}
    for (o, T, N), by_kernel in forced(records).items():
        others = [r["median_us"] for k, r in by_kernel.items() if k != "persistent"]
        if o == op and "persistent" in by_kernel and others:
            ratio[(N, T)] = by_kernel["persistent"]["median_us"] / min(others)
    out = {}
    for N in sorted({n for n, _ in ratio}):
        tokens = sorted(t for n, t in ratio if n == N)
        out[N] = next((T for i, T in enumerate(tokens)
                       if all(ratio[(N, t)] <= PERSISTENT_MARGIN for t in tokens[i:])), None)
    return out


def summary(records: list[dict]) -> list[str]:
    """Per op: a row per N, a column per T with the default's µs, its share of the copy rate and its kernel; with
    --forced, '(k x.xx)' where a forced kernel k was faster than the default by more than 3 % (x: default / k), and
    under each op the persistent kernel's threshold per N (persistent_from)."""
    rec = _records(records)
    if not rec:
        return []
    cell = {(r["op"], r["T"], r["N"]): r for r in rec}
    best = fastest_forced(records)
    tokens = sorted({r["T"] for r in rec})
    copy = next(r["copy_tbs"] for r in rec)
    lines = [f"prefill grid: the default options, µs (% of the copy rate, {copy:.2f} TB/s) and kernel, cold L2, "
             f"H = {rec[0]['H']}; '<' under {100 * TARGET_FRACTION:.0f}%"]
    for op in [o for o in OPS if any(r["op"] == o for r in rec)]:
        lines.append(f"{op} ({function_name(op)}, {addends(op)} addend{'' if addends(op) == 1 else 's'})")
        lines.append(f"{'N':>4}" + "".join(f"{'T = ' + str(T):>{44 if best else 34}}" for T in tokens))
        for N in sorted({r["N"] for r in rec if r["op"] == op}):
            row = f"{N:4d}"
            for T in tokens:
                r = cell.get((op, T, N))
                text = "-" if r is None else (f"{r['median_us']:.1f} ({r['pct_copy']:.0f}%"
                                               f"{'<' if r['pct_copy'] < 100 * TARGET_FRACTION else ''}) "
                                               f"{r['kernel']}")
                b = best.get((op, T, N))
                if r is not None and b is not None and r["median_us"] > 1.03 * b["median_us"]:
                    text += f" ({b['provider'].split('/')[1]} {r['median_us'] / b['median_us']:.2f})"
                row += text.rjust(44 if best else 34)
            lines.append(row)
        start = persistent_from(records, op)
        if start:
            lines.append(f"  the persistent kernel >= {1 / PERSISTENT_MARGIN - 1:.0%} faster than the other kernels "
                         "from T (at every larger T; '-': at none): "
                         + ", ".join(f"N={N}: {'-' if T is None else T}" for N, T in start.items()))
    return lines
