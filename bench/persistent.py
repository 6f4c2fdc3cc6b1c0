"""The persistent-kernel sweep (python -m bench persistent): attn_res_add_rmsnorm_persistent (one block
per SM, rows streamed through shared memory) against the per-token kernel the library picks under the
per_token topology (split_k at these N) and torch.compile of the PyTorch step, at T in
{32, 64, 128, 256, 512, 1024, 4096, 16384, 32768} x N in {2, 5, 9, 12}, with and without the addend, H = 7168
by default. All three providers of a point are CUDA-graph replays timed interleaved in the same run.

Reported per point: µs per call, GB/s over the bytes the op must move (`op_bytes`: N - 1 bank rows, the
prefix and, with the addend, the addend read; `updated` (with the addend) and `output` written; the three
weight rows read once) and that bandwidth as a share of the device-to-device copy bandwidth measured at the
start of the suite (floors.copy_bandwidth_tbs; read + write counted, like op_bytes). From the points: the
per-token/persistent crossover (the smallest T of the sweep from which the persistent kernel is faster at
every larger T, per N and addend: the value to give Options.split_max_tokens is the T just below it) and
the bandwidth target (T >= 4096, N = 9, with the addend: >= 85% of the copy bandwidth).

Input sets rotate inside each graph until their bytes exceed twice the L2 (at large T one set already does),
so the bank streams from DRAM as in a serving engine.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

import attnres
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import EPS, compiled, make_sets, torch_attn_res_step

TOKENS = (32, 64, 128, 256, 512, 1024, 4096, 16384, 32768)
CANDIDATES = (2, 5, 9, 12)
QUICK_TOKENS = (64, 1024, 16384)
QUICK_CANDIDATES = (9,)
H_DEFAULT = 7168
PROVIDERS = ("attnres/persistent", "attnres/per_token", "torch_compile_step")
P5_FRACTION = 0.85


def op_bytes(T: int, N: int, H: int, add: bool) -> int:
    """Bytes the op must move: reads of N - 1 bank rows + the prefix (+ the addend) per token, writes of output
    (+ updated) per token, and the res/rms/norm weight rows once."""
    row = 2 * H
    return T * row * ((N - 1) + 1 + int(add)) + T * row * (1 + int(add)) + 3 * row


def points(quick: bool = False) -> list[tuple[int, int, bool]]:
    tokens, cands = (QUICK_TOKENS, QUICK_CANDIDATES) if quick else (TOKENS, CANDIDATES)
    return [(T, N, add) for add in (True, False) for N in cands for T in tokens]


def _call(s, provider: str, add: bool, pdl: bool) -> Callable[[], object]:
    w = (s.res_weight, s.rms_weight, s.norm_weight, EPS, EPS)
    addend = s.routed if add else None
    if provider == "attnres/persistent":
        opts = attnres.Options(topology="persistent", pdl=pdl)
        return lambda: attnres.attn_res_add_rmsnorm_persistent(s.prefix, s.bank, *w, layer_residual_add=addend,
                                                               options=opts)
    if provider == "attnres/per_token":
        opts = attnres.Options(topology="per_token", pdl=pdl)
        if add:
            return lambda: attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *w, options=opts)
        return lambda: attnres.attn_res_rmsnorm(s.prefix, s.bank, *w, options=opts)
    if provider == "torch_compile_step":
        fn = compiled(torch_attn_res_step)
        return lambda: fn(s.prefix, addend, s.bank, s.res_weight, s.rms_weight, s.norm_weight)
    raise ValueError(f"unknown provider {provider!r}")


def run_point(T: int, N: int, H: int, add: bool, *, pdl: bool, copy_tbs: float, repeats: int,
              providers=PROVIDERS) -> list[dict]:
    nbytes = op_bytes(T, N, H, add)
    # At large T one set is already gigabytes: no minimum beyond what makes the rotation exceed the L2.
    sets = make_sets(T, N, H, rotating_sets(nbytes, minimum=1), seed=T * 100 + N + 7 * add)
    graphs = {p: (capture([_call(s, p, add, pdl) for s in sets]), len(sets)) for p in providers}
    timings = time_interleaved(graphs, repeats=repeats)
    q = dict(tokens=T, candidates=N, hidden=H, device="cuda", add=add)
    persistent = attnres.plan("attn_res_add_rmsnorm_persistent", **q, options=attnres.Options(pdl=pdl))
    per_token = attnres.plan("attn_res_add_rmsnorm" if add else "attn_res_rmsnorm", **q,
                             options=attnres.Options(pdl=pdl))
    records = []
    for name, t in timings.items():
        gbps = nbytes / (t.median_us * 1e-6) / 1e9
        plan = persistent if name == "attnres/persistent" else per_token if name == "attnres/per_token" else None
        records.append({
            "suite": "persistent", "provider": name, "T": T, "N": N, "H": H, "add": add, "pdl": pdl,
            "sets": len(sets), "bytes": nbytes, "gbps": gbps, "copy_tbs": copy_tbs,
            "pct_copy": 100.0 * gbps / (copy_tbs * 1000.0),
            "kernel": plan.kernel if plan else None,
            "geometry": ({"blocks": plan.blocks, "threads": plan.threads, "vectors": plan.vectors,
                          "slots": plan.slots, "passes": plan.passes, "smem_bytes": plan.smem_bytes}
                         if plan is persistent else {"cluster": plan.cluster, "threads": plan.threads}
                         if plan else None),
            **t.as_dict()})
    return records


def run(quick: bool = False, H: int = H_DEFAULT, pdl: bool = True, copy_tbs: float | None = None, progress=None,
        repeats: int = 25) -> list[dict]:
    if copy_tbs is None:
        from .floors import copy_bandwidth_tbs

        copy_tbs = copy_bandwidth_tbs()
    records = []
    pts = points(quick)
    for i, (T, N, add) in enumerate(pts):
        records += run_point(T, N, H, add, pdl=pdl, copy_tbs=copy_tbs, repeats=repeats)
        torch.cuda.empty_cache()  # the largest points hold gigabytes; give them back before the next
        if progress:
            progress(i + 1, len(pts), f"persistent T={T} N={N} add={add}")
    return records


# ------------------------------------------------------------------------------------------- reading records
def _persistent_records(records):
    return [r for r in records if r.get("suite") == "persistent"]


def crossover(records: list[dict]) -> dict[tuple[bool, int, int], int | None]:
    """(add, N, H) -> the smallest T of the sweep from which the persistent kernel is faster than the per-token
    kernel at that T and at every larger T measured; None when it is not faster at the largest T."""
    by_key = defaultdict(dict)
    for r in _persistent_records(records):
        if r["provider"] in ("attnres/persistent", "attnres/per_token"):
            by_key[(r["add"], r["N"], r["H"])].setdefault(r["T"], {})[r["provider"]] = r["median_us"]
    out = {}
    for key, per_T in by_key.items():
        both = sorted(T for T, v in per_T.items() if len(v) == 2)
        first = None
        for T in reversed(both):
            if per_T[T]["attnres/persistent"] < per_T[T]["attnres/per_token"]:
                first = T
            else:
                break
        out[key] = first
    return out


def p5_target(records: list[dict]) -> tuple[str, str, str, bool] | None:
    """Target P5 (docs/performance.md): the persistent kernel at T >= 4096, N = 9, with the addend, moves its
    bytes at >= 85% of the copy bandwidth. The worst such point decides."""
    pts = [r for r in _persistent_records(records)
           if r["provider"] == "attnres/persistent" and r["T"] >= 4096 and r["N"] == 9 and r["add"]]
    if not pts:
        return None
    worst = min(pts, key=lambda r: r["pct_copy"])
    return ("P5", "persistent kernel, T >= 4096, N = 9, with add: >= 85% of the copy bandwidth",
            f"worst {worst['pct_copy']:.1f}% ({worst['gbps']:.0f} GB/s of {worst['copy_tbs']:.2f} TB/s) at "
            f"T={worst['T']} H={worst['H']}", worst["pct_copy"] >= 100 * P5_FRACTION)


def summary(records: list[dict]) -> list[str]:
    """A table per (addend, H): for each T and N the three providers' µs and the persistent kernel's share of the
    copy bandwidth; then the crossover per N."""
    rec = _persistent_records(records)
    if not rec:
        return []
    lines = []
    cell = {(r["add"], r["H"], r["N"], r["T"], r["provider"]): r for r in rec}
    for add in sorted({r["add"] for r in rec}, reverse=True):
        for H in sorted({r["H"] for r in rec if r["add"] == add}):
            Ns = sorted({r["N"] for r in rec if r["add"] == add and r["H"] == H})
            Ts = sorted({r["T"] for r in rec if r["add"] == add and r["H"] == H})
            lines.append(f"persistent sweep, H={H}, {'with' if add else 'without'} the addend: "
                         "µs persistent / per-token / torch.compile (persistent % of copy bandwidth)")
            lines.append("T".rjust(7) + "".join(f"N={N}".rjust(36) for N in Ns))
            for T in Ts:
                row = f"{T:7d}"
                for N in Ns:
                    got = [cell.get((add, H, N, T, p)) for p in PROVIDERS]
                    us = "/".join(f"{g['median_us']:.1f}" if g else "-" for g in got)
                    pct = f" ({got[0]['pct_copy']:.0f}%)" if got[0] else ""
                    row += f"{us}{pct}".rjust(36)
                lines.append(row)
    for (add, N, H), T in sorted(crossover(records).items()):
        lines.append(f"crossover H={H} N={N} {'add' if add else 'no add'}: "
                     + (f"persistent faster from T={T} on" if T else "per-token faster at every T measured"))
    return lines
