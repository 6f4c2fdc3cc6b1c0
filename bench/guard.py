"""The quick regression guard: a handful of key points measured the way the full suites measure them (CUDA-graph
replay over rotating input sets, interleaved), compared with a committed results file.

Points: the decode add2 op (the fold) at T = 1, N = 2 and 9 and at T = 32, N = 9; the MoE finalize at T = 1;
and, at each decode point, the two eager MoE-tail adds as a same-run reference. The reference is plain PyTorch
elementwise kernels that no attnres change touches: if it moved, the machine moved (clocks, driver, another
tenant), so every kernel ratio is also divided by the references' median ratio ("vs ref") to separate machine
drift from a kernel change.

Noise: a point's relative noise is its baseline and new p10-p90 spreads combined, each over its median; a change
counts only beyond max(3 x that noise, a 3% floor) — and, when the references were measured, beyond the same
bound after the drift normalisation too. A point slower on both counts is a REGRESSION (non-zero exit); slower
only in raw time, with the reference slower too, is "drift"; slower only against the reference is "vs ref"
(reported, not failed: the reference is a different kernel, and machine speed-ups do not reach both alike).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field

import attnres
from attnres.bench.finalize import D as FIN_D, K as FIN_K, input_sets as finalize_sets
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import attnres_call, eager_tail_adds, make_sets, step_bytes
from attnres.moe import moe_finalize

K_NOISE = 3.0
FLOOR = 0.03
H = 7168
DECODE_POINTS = ((1, 2), (1, 9), (32, 9))
FINALIZE_T = 1
KERNEL = "kernel"
REFERENCE = "reference"

# Statuses. Only REGRESSION fails the guard.
OK, REGRESSION, IMPROVED, DRIFT, VS_REF, NO_BASELINE, NOT_MEASURED, MOVED = (
    "ok", "REGRESSION", "improved", "drift", "vs ref", "no baseline", "not measured", "moved")


@dataclass(frozen=True)
class Point:
    label: str
    role: str  # KERNEL or REFERENCE
    key: tuple[tuple[str, object], ...]  # the record fields that identify it in a results file

    def matches(self, record: dict) -> bool:
        return all(record.get(k) == v for k, v in self.key)


def points(hidden: int = H) -> list[Point]:
    out = []
    for T, N in DECODE_POINTS:
        base = (("suite", "decode"), ("T", T), ("N", N), ("H", hidden))
        out.append(Point(f"decode add2 T={T} N={N}", KERNEL, (*base, ("provider", "attnres/add2"))))
    out.append(Point(f"moe_finalize T={FINALIZE_T}", KERNEL,
                     (("suite", "finalize"), ("provider", "attnres/moe_finalize"), ("T", FINALIZE_T), ("k", 16),
                      ("D", 3584))))
    for T, N in DECODE_POINTS:
        base = (("suite", "decode"), ("T", T), ("N", N), ("H", hidden))
        out.append(Point(f"eager tail adds T={T} N={N}", REFERENCE, (*base, ("provider", "eager_tail_adds"))))
    return out


def _find(records: list[dict], point: Point) -> dict | None:
    found = [r for r in records if point.matches(r)]
    return found[-1] if found else None  # a file with repeats of a point: the last one written


def _rel_spread(r: dict) -> float:
    return max(r["p90_us"] - r["p10_us"], 0.0) / r["median_us"]


@dataclass
class Row:
    point: Point
    base: dict | None
    new: dict | None
    ratio: float | None = None  # new / base median
    bound: float | None = None  # the relative change that counts (max(3 x noise, floor))
    norm_ratio: float | None = None  # ratio / drift
    norm_bound: float | None = None
    status: str = OK


@dataclass
class Report:
    rows: list[Row]
    drift: float | None  # median new/base of the references (None: not measured on both sides)
    drift_noise: float | None
    base_meta: dict = field(default_factory=dict)
    new_meta: dict = field(default_factory=dict)
    k: float = K_NOISE
    floor: float = FLOOR

    @property
    def regressions(self) -> list[Row]:
        return [r for r in self.rows if r.status == REGRESSION]

    @property
    def compared(self) -> list[Row]:
        return [r for r in self.rows if r.point.role == KERNEL and r.ratio is not None]

    def exit_code(self) -> int:
        """1 on a regression; 2 when no kernel point could be compared (nothing was guarded); else 0."""
        if self.regressions:
            return 1
        return 0 if self.compared else 2


def compare(baseline: list[dict], new: list[dict], *, k: float = K_NOISE, floor: float = FLOOR,
            hidden: int = H, base_meta: dict | None = None, new_meta: dict | None = None) -> Report:
    pts = points(hidden)
    rows = []
    for p in pts:
        row = Row(p, _find(baseline, p), _find(new, p))
        if row.base is None:
            row.status = NO_BASELINE
        elif row.new is None:
            row.status = NOT_MEASURED
        else:
            row.ratio = row.new["median_us"] / row.base["median_us"]
            noise = math.hypot(_rel_spread(row.base), _rel_spread(row.new))
            row.bound = max(k * noise, floor)
            if p.role == REFERENCE:
                row.status = MOVED if abs(row.ratio - 1) > row.bound else OK
        rows.append(row)

    refs = [r for r in rows if r.point.role == REFERENCE and r.ratio is not None]
    drift = statistics.median(r.ratio for r in refs) if refs else None
    drift_noise = (statistics.median(math.hypot(_rel_spread(r.base), _rel_spread(r.new)) for r in refs)
                   if refs else None)

    for row in rows:
        if row.point.role != KERNEL or row.ratio is None:
            continue
        slower, faster = row.ratio - 1 > row.bound, 1 - row.ratio > row.bound
        if drift is None:
            row.status = REGRESSION if slower else IMPROVED if faster else OK
            continue
        row.norm_ratio = row.ratio / drift
        noise = math.hypot(math.hypot(_rel_spread(row.base), _rel_spread(row.new)), drift_noise)
        row.norm_bound = max(k * noise, floor)
        norm_slower, norm_faster = row.norm_ratio - 1 > row.norm_bound, 1 - row.norm_ratio > row.norm_bound
        if slower and norm_slower:
            row.status = REGRESSION
        elif slower:
            row.status = DRIFT
        elif norm_slower:
            row.status = VS_REF
        elif faster and norm_faster:
            row.status = IMPROVED
        else:
            row.status = OK
    return Report(rows, drift, drift_noise, base_meta or {}, new_meta or {}, k, floor)


# ------------------------------------------------------------------------------------------ output
def _timing(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['median_us']:.2f} ({r['p10_us']:.2f}-{r['p90_us']:.2f})"


def _plan(r: dict | None) -> str:
    if r is None or not r.get("kernel"):
        return ""
    return f"{r['kernel']}/{r['cluster']}" if r.get("cluster") else str(r["kernel"])


def _pct(x: float | None, sign: bool = True) -> str:
    if x is None:
        return "-"
    return f"{x * 100:+.1f}%" if sign else f"{x * 100:.1f}%"


def format_report(report: Report) -> list[str]:
    b, n = report.base_meta, report.new_meta
    lines = []
    if b or n:
        lines.append(f"baseline: {b.get('gpu', '?')} commit {b.get('commit', '?')}   new: {n.get('gpu', '?')} "
                     f"commit {n.get('commit', '?')}")
        if b.get("gpu") and n.get("gpu") and b["gpu"] != n["gpu"]:
            lines.append("WARNING: different GPUs: the comparison says little")
        elif not (b.get("gpu_uuid") and b.get("gpu_uuid") == n.get("gpu_uuid")):
            same = "unknown" if not (b.get("gpu_uuid") and n.get("gpu_uuid")) else "different"
            lines.append(f"NOTE: {same} physical GPUs (baseline {b.get('gpu_uuid') or '?'} on {b.get('host') or '?'}, "
                         f"new {n.get('gpu_uuid') or '?'} on {n.get('host') or '?'}): two H200s ran the same build's "
                         "split_k kernels up to 0.25 us apart, which the same-run reference does not see; confirm "
                         "a REGRESSION on one GPU (tools/ab_commits.sh)")
    header = (f"{'point':<26} {'baseline us (p10-p90)':>22} {'new us (p10-p90)':>22} {'change':>8} {'bound':>7} "
              f"{'vs ref':>8} {'bound':>7}  {'status':<12} plan")
    lines += [header, "-" * len(header)]
    for r in report.rows:
        plan_b, plan_n = _plan(r.base), _plan(r.new)
        plan = plan_n if plan_b == plan_n else f"{plan_b or '?'} -> {plan_n or '?'}"
        lines.append(f"{r.point.label:<26} {_timing(r.base):>22} {_timing(r.new):>22} "
                     f"{_pct(None if r.ratio is None else r.ratio - 1):>8} {_pct(r.bound, False):>7} "
                     f"{_pct(None if r.norm_ratio is None else r.norm_ratio - 1):>8} {_pct(r.norm_bound, False):>7}  "
                     f"{r.status:<12} {plan}")
    if report.drift is None:
        lines.append("same-run reference: not measured on both sides; raw comparison only")
    else:
        lines.append(f"same-run reference (eager tail adds): x{report.drift:.3f} vs baseline (noise "
                     f"{report.drift_noise * 100:.1f}%): " + ("the machine moved" if abs(report.drift - 1) >
                                                              max(report.k * report.drift_noise, report.floor)
                                                              else "the machine is comparable"))
    code = report.exit_code()
    lines.append({0: "guard: no regression", 1: f"guard: {len(report.regressions)} REGRESSION(S)",
                  2: "guard: no kernel point could be compared (wrong baseline file?)"}[code])
    return lines


def load(path: str) -> tuple[dict, list[dict]]:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path}: not an attnres.bench results file (no 'records' list)")
    return data.get("meta", {}), data["records"]


# ------------------------------------------------------------------------------------------ measurement
def measure(*, repeats: int = 25, hidden: int = H, options=None, progress=None) -> list[dict]:
    """The guard's points on this GPU, records in the decode / finalize suites' format (same keys)."""
    options = options or attnres.Options()
    records = []
    total = len(DECODE_POINTS) + 1
    for i, (T, N) in enumerate(DECODE_POINTS):
        sets = make_sets(T, N, hidden, rotating_sets(step_bytes(T, N, hidden)), seed=T * 100 + N)
        graphs = {"attnres/add2": (capture([attnres_call(s, "add2", options) for s in sets]), len(sets)),
                  "eager_tail_adds": (capture([eager_tail_adds(s) for s in sets]), len(sets))}
        plan = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=N, hidden=hidden, device="cuda", add=True,
                            add2=True, options=options)
        for name, t in time_interleaved(graphs, repeats=repeats).items():
            ours = name.startswith("attnres")
            records.append({"suite": "decode", "provider": name, "T": T, "N": N, "H": hidden, "sets": len(sets),
                            "kernel": plan.kernel if ours else None, "cluster": plan.cluster if ours else None,
                            "pdl": options.pdl, "bytes": step_bytes(T, N, hidden), "guard": True, **t.as_dict()})
        del graphs
        if progress:
            progress(i + 1, total, f"guard decode T={T} N={N}")
    T = FINALIZE_T
    bytes_per_set = (T * FIN_K + 8) * FIN_D * 2 + T * FIN_K * 8 + T * FIN_D * 2 * 2 + FIN_D * 2
    sets = finalize_sets(T, rotating_sets(bytes_per_set), seed=T)
    g = capture([lambda s=s: moe_finalize(s[0], s[1], s[2], shared=s[3], norm_weight=s[4], eps=1e-5) for s in sets])
    t = time_interleaved({"attnres/moe_finalize": (g, len(sets))}, repeats=repeats)["attnres/moe_finalize"]
    records.append({"suite": "finalize", "provider": "attnres/moe_finalize", "T": T, "k": FIN_K, "D": FIN_D,
                    "sets": len(sets), "guard": True, **t.as_dict()})
    if progress:
        progress(total, total, "guard finalize T=1")
    return records
