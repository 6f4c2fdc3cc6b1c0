"""The FP8 epilogue's cost (issue 19's target: <= 0.2 us over the bf16 op): attn_res_add_rmsnorm with add2 (the
decode op, H = 7168) with fp8 = per_token / block128, with the bf16 output and without it (fp8_only, the call an
FP8 GEMM's producer makes: the target is judged on it where measured), against the same op in bf16, and against
the bf16 op followed by a separate quantization of its output (attnres.fp8.quantize in PyTorch eager, and torch.compile of it), at
T in {1, 4, 8, 32} and N in {2, 9, 12}. Every variant of a point is one CUDA graph over rotating input sets
(cold-ish L2), replayed interleaved with the others. Each point also checks that the fused codes and scales equal
the reference quantization of the op's own bf16 output (`bitwise_equal` in the records)."""

from __future__ import annotations

import torch

import attnres
from attnres import fp8 as _fp8
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import EPS, StepSet, make_sets, step_bytes

H_DEFAULT = 7168
TOKENS = (1, 4, 8, 32)
CANDIDATES = (2, 9, 12)
QUICK_POINTS = ((1, 9), (32, 9))
MODES = _fp8.MODES
TARGET_US = 0.2
BF16_OP = "attnres/add2"


def points(quick: bool = False) -> list[tuple[int, int]]:
    return list(QUICK_POINTS) if quick else [(T, N) for T in TOKENS for N in CANDIDATES]


def _op(s: StepSet, options: attnres.Options, mode: str | None = None, pow2: bool = False, only: bool = False):
    return attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, s.res_weight, s.rms_weight, s.norm_weight, EPS,
                                        EPS, layer_residual_add2=s.shared, fp8=mode, fp8_pow2_scales=pow2,
                                        fp8_only=only, options=options)


_compiled: dict = {}


def compiled_quantize():
    """torch.compile of the reference quantization (inductor; mode and pow2 are constants it specializes on)."""
    if "q" not in _compiled:
        _compiled["q"] = torch.compile(_fp8.quantize, dynamic=True)
    return _compiled["q"]


def _calls(sets: list[StepSet], options: attnres.Options, mode: str, pow2: bool) -> dict[str, list]:
    comp = compiled_quantize()
    return {
        f"attnres/add2_fp8_{mode}": [lambda s=s: _op(s, options, mode, pow2) for s in sets],
        f"attnres/add2_fp8_only_{mode}": [lambda s=s: _op(s, options, mode, pow2, True) for s in sets],
        f"add2_then_eager_quant_{mode}": [lambda s=s: _fp8.quantize(_op(s, options)[1], mode, pow2) for s in sets],
        f"add2_then_compiled_quant_{mode}": [lambda s=s: comp(_op(s, options)[1], mode, pow2) for s in sets],
    }


def _bitwise_ok(s: StepSet, options: attnres.Options, mode: str, pow2: bool) -> bool:
    """The fused codes and scales = quantize of the op's output, that output = the bf16 op's, and the FP8-only
    call's results = the fused call's."""
    updated, output, codes, scales = _op(s, options, mode, pow2)
    ref_codes, ref_scales = _fp8.quantize(output, mode, pow2)
    bf16_output = _op(s, options)[1]
    only = _op(s, options, mode, pow2, True)
    return (torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
            and torch.equal(scales.contiguous().view(torch.int32), ref_scales.view(torch.int32))
            and torch.equal(output.view(torch.int16), bf16_output.view(torch.int16))
            and torch.equal(only[0].view(torch.int16), updated.view(torch.int16))
            and torch.equal(only[1].view(torch.uint8), codes.view(torch.uint8))
            and torch.equal(only[2].contiguous().view(torch.int32), scales.contiguous().view(torch.int32)))


def run_point(T: int, N: int, H: int, options: attnres.Options, repeats: int, pow2: bool = False) -> list[dict]:
    out_bytes = T * H + T * max(1, H // _fp8.GROUP) * 4  # the codes and the scales
    sets = make_sets(T, N, H, rotating_sets(step_bytes(T, N, H) + out_bytes), seed=T * 100 + N + 19)
    graphs = {BF16_OP: (capture([lambda s=s: _op(s, options) for s in sets]), len(sets))}
    errors: dict[str, str] = {}
    for mode in MODES:
        if mode == "block128" and H % _fp8.GROUP:
            continue
        for name, calls in _calls(sets, options, mode, pow2).items():
            try:
                graphs[name] = (capture(calls), len(sets))
            except Exception as e:  # torch.compile failing to capture must not cost the other variants' numbers
                errors[name] = f"{type(e).__name__}: {e}"[:300]
    timings = time_interleaved(graphs, repeats=repeats)
    checks = {mode: _bitwise_ok(sets[0], options, mode, pow2) for mode in MODES
              if not (mode == "block128" and H % _fp8.GROUP)}
    records = []
    for name in list(graphs) + list(errors):
        mode = next((m for m in MODES if name.endswith(m)), None)
        plan = attnres.plan("attn_res_add_rmsnorm", tokens=T, candidates=N, hidden=H, device="cuda", add=True,
                            add2=True, fp8=mode if name.startswith("attnres/") else None,
                            fp8_pow2_scales=pow2 and name.startswith("attnres/") and mode is not None,
                            options=options)
        rec = {"suite": "fp8", "provider": name, "mode": mode, "pow2": pow2, "T": T, "N": N, "H": H,
               "sets": len(sets), "kernel": plan.kernel, "pdl": options.pdl,
               "bitwise_equal": checks.get(mode) if name.startswith("attnres/") and mode else None}
        if name in errors:
            rec["error"] = errors[name]
        else:
            rec.update(timings[name].as_dict())
        records.append(rec)
    return records


def run(quick: bool = False, H: int = H_DEFAULT, options: attnres.Options | None = None, progress=None,
        repeats: int = 25, pow2: bool = False) -> list[dict]:
    options = options or attnres.Options()
    records = []
    pts = points(quick)
    for i, (T, N) in enumerate(pts):
        records += run_point(T, N, H, options, repeats, pow2)
        if progress:
            progress(i + 1, len(pts), f"fp8 T={T} N={N}")
    return records


def _median(records: list[dict], provider: str, T: int, N: int) -> float | None:
    for r in records:
        if r.get("suite") == "fp8" and r["provider"] == provider and r["T"] == T and r["N"] == N:
            return r.get("median_us")
    return None


def table(records: list[dict]) -> list[tuple]:
    """(T, N, mode, bf16 op, fused fp8, its cost over bf16, + eager quant cost, + compiled quant cost, FP8-only, its
    cost over bf16), in us (None where not measured)."""
    rows = []
    pts = sorted({(r["T"], r["N"]) for r in records if r.get("suite") == "fp8"})
    for T, N in pts:
        base = _median(records, BF16_OP, T, N)
        for mode in MODES:
            fused = _median(records, f"attnres/add2_fp8_{mode}", T, N)
            if base is None or fused is None:
                continue
            eager = _median(records, f"add2_then_eager_quant_{mode}", T, N)
            comp = _median(records, f"add2_then_compiled_quant_{mode}", T, N)
            only = _median(records, f"attnres/add2_fp8_only_{mode}", T, N)
            rows.append((T, N, mode, base, fused, fused - base, None if eager is None else eager - base,
                         None if comp is None else comp - base, only, None if only is None else only - base))
    return rows


def target(records: list[dict]) -> tuple[str, str, bool] | None:
    """(what, measured, met): the worst FP8 epilogue cost over the bf16 op against TARGET_US, and the bitwise
    checks of every point."""
    rows = table(records)
    if not rows:
        return None
    # The FP8-only call's cost where measured (what an FP8 GEMM's producer calls), else the fused call's.
    judged = [(*r[:5], r[9] if r[9] is not None else r[5], r[9] is not None) for r in rows]
    worst = max(judged, key=lambda r: r[5])
    bad = sorted({(r["T"], r["N"], r["mode"]) for r in records
                  if r.get("suite") == "fp8" and r.get("bitwise_equal") is False})
    measured = (f"worst +{worst[5]:.3f} us at T={worst[0]} N={worst[1]} {worst[2]}"
                f"{' (FP8-only)' if worst[6] else ''}; "
                + ("codes and scales bitwise = quantize(output) at every point" if not bad
                   else f"NOT bitwise equal at {bad}"))
    return (f"FP8 epilogue (add2 op, H={records[0]['H']}; the FP8-only call where measured) costs <= {TARGET_US} us "
            "over the bf16 op", measured,
            worst[5] <= TARGET_US and not bad)


def summary(records: list[dict]) -> list[str]:
    rows = table(records)
    if not rows:
        return []
    fmt = lambda v: "   -   " if v is None else f"{v:+7.2f}"  # noqa: E731
    lines = ["fp8 (us; cost = time - bf16 op):   T   N  mode       bf16   fused  cost   +eager quant  +compiled quant"
             "  FP8-only cost"]
    for T, N, mode, base, fused, cost, eager, comp, _, only_cost in rows:
        lines.append(f"{'':34}{T:>3} {N:>3}  {mode:<9} {base:6.2f} {fused:6.2f} {cost:+6.3f}   {fmt(eager)}"
                     f"        {fmt(comp)}         {fmt(only_cost)}")
    for r in records:
        if r.get("suite") == "fp8" and "error" in r:
            lines.append(f"fp8: {r['provider']} at T={r['T']} N={r['N']} not measured: {r['error']}")
    what, measured, met = target(records)
    lines.append(f"target: {what}: {measured} -> {'met' if met else 'MISSED'}")
    return lines
