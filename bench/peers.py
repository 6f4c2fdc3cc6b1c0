"""The side-by-side points (python -m bench peers): attn_res_add_rmsnorm with one addend (`prefix +
delta`, output RMSNorm) at the (T, N) points of the kernels issue's table against the other Hopper kernels,
plus the persistent range (T = 1024, 4096, 16384 x N = 2, 9, 12), H = 7168.

At every point: the default options (`Options()`, the automatic topology: what a user gets) and each kernel the
call can run on, forced (split_k; the single_cta, streaming above one token per SM, where N <= 4; the persistent
kernel), all CUDA-graph replays timed interleaved in the same run, in two L2 regimes:

* `warm`: the rotating input sets together fit in half the L2, so after the warm-up replays the rows are
  L2-resident: the regime of the peers' figures below. Each graph holds enough calls to amortize a replay's
  launch (calls_per_graph), cycling through its sets. Where one set is larger than half the L2 the point has
  no warm regime (the rows stream from DRAM either way) and only `cold` is measured.
* `cold`: the project's harness (timing.rotating_sets: the sets exceed twice the L2).

The peers' figures (`PEERS`) are the ones of the issue's side-by-side run on one H200 (the same process and
inputs for every kernel, warm-L2 rotating sets, one addend, µs per call): the best other Hopper kernel at each
point (FlagGems' Triton kernels, among them the one of FlagGems-vllm pull request 737, and vLLM's Triton kernel)
and vLLM's. They are an H200's, so the table compares the default options' warm figure with them on an H200 only
(`PEERS_GPU`); on another GPU a record carries no peer figure. The copy floor of the same run
(floors.copy_bandwidth_tbs) says how far the large-T points are from the bytes' transfer time. vLLM's and
FlagGems-vllm's kernels are re-measured side by side, on any Hopper GPU, by `tools/engines/bench_vllm.py run
--flaggems` (docs/integrations.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import attnres
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import EPS, make_sets

from .grid import copy_rate, measure
from .persistent import op_bytes

H_DEFAULT = 7168
PEERS_GPU = "H200"  # the GPU of the peers' figures: records of another GPU are not compared with them


@dataclass(frozen=True)
class Peer:
    best_us: float  # the best other Hopper kernel at the point
    best: str  # which one
    vllm_us: float  # vLLM's Hopper Triton kernel


# (T, N) -> the peers' µs in the issue's run (H = 7168, one addend, warm L2).
PEERS: dict[tuple[int, int], Peer] = {
    (1, 1): Peer(2.21, "FlagGems-vllm PR 737 (Triton)", 2.43),
    (1, 2): Peer(3.63, "vLLM (Triton)", 3.63),
    (1, 5): Peer(4.25, "FlagGems (Triton)", 5.58),
    (1, 9): Peer(6.38, "FlagGems (Triton)", 7.09),
    (1, 12): Peer(7.48, "vLLM (Triton)", 7.48),
    (8, 9): Peer(7.12, "FlagGems (Triton)", 7.87),
    (32, 9): Peer(7.89, "FlagGems (Triton)", 8.71),
    (128, 9): Peer(10.50, "FlagGems (Triton)", 11.35),
    (1024, 9): Peer(63.5, "FlagGems (Triton)", 65.6),
    (4096, 2): Peer(79.5, "FlagGems (Triton)", 97.7),
    (4096, 9): Peer(236.5, "FlagGems (Triton)", 247.3),
}
PERSISTENT_RANGE = [(T, N) for T in (1024, 4096, 16384) for N in (2, 9, 12)]
QUICK_POINTS = [(1, 1), (1, 9), (128, 9), (4096, 2), (4096, 9)]
REGIMES = ("warm", "cold")
# Calls per graph: a replay costs ~5 us of launch beyond its calls (one call of T = 128, N = 9 timed 13.9 us per
# replay against 9.05 per call with 32; T = 4096, N = 2: 86.8 against 81.1), so a graph holds at least
# MIN_CALLS calls and enough for REPLAY_US of work at an estimate of a call's time (its bytes at
# ESTIMATE_TBS, at least ESTIMATE_MIN_US), cycling through its sets: at T = 1 ~250 calls, where 32 left ~0.15 us
# of launch in each call. A cold regime stays cold: a set comes back only after all the others, whose bytes
# exceed twice the L2.
MIN_CALLS = 32
REPLAY_US = 500.0
ESTIMATE_TBS = 3.0
ESTIMATE_MIN_US = 2.0


def calls_per_graph(sets: int, nbytes: int) -> int:
    estimate_us = max(ESTIMATE_MIN_US, nbytes / (ESTIMATE_TBS * 1e12) * 1e6)
    return max(sets, MIN_CALLS, math.ceil(REPLAY_US / estimate_us))


# The kernels a point is timed on besides the default, as Options(kernel=...) / topology; where the plan declines
# a forced kernel for the call (single_cta above N = 4), it is left out of that point.
FORCED = {"split_k": dict(kernel="split_k"), "single_cta": dict(kernel="single_cta"),
          "persistent": dict(topology="persistent")}


def points(quick: bool = False) -> list[tuple[int, int]]:
    if quick:
        return list(QUICK_POINTS)
    return sorted(set(PEERS) | set(PERSISTENT_RANGE))


def warm_sets(bytes_per_set: int, l2_bytes: int, maximum: int = 8) -> int:
    """How many rotating sets fit in half the L2 (at most `maximum`); 0 when one set does not."""
    return min(maximum, (l2_bytes // 2) // max(bytes_per_set, 1))


def op_name(add: bool, mix: bool = False) -> str:
    """The op a point times: one addend (`prefix + delta`, then the norm), or none (attn_res_rmsnorm); mix:
    attn_res (no trailing norm, no fp32 diagnostics), with or without the addend."""
    if mix:
        return "attn_res"
    return "attn_res_add_rmsnorm" if add else "attn_res_rmsnorm"


def _plan(T: int, N: int, H: int, add: bool, options: attnres.Options, device="cuda", mix: bool = False):
    return attnres.plan(op_name(add, mix), tokens=T, candidates=N, hidden=H, device=device, add=add, options=options)


def _providers(T: int, N: int, H: int, device="cuda", add: bool = True,
               mix: bool = False) -> dict[str, attnres.Options]:
    """default (Options()) and every kernel the plan runs this call on when forced, by provider name."""
    out = {"attnres/default": attnres.Options()}
    for name, kw in FORCED.items():
        opts = attnres.Options(**kw)
        if _plan(T, N, H, add, opts, device, mix).kernel is not None:
            out[f"attnres/{name}"] = opts
    return out


def call(s, opts: attnres.Options, add: bool = True, mix: bool = False):
    if mix:
        return lambda: attnres.attn_res(s.prefix, s.bank, s.res_weight, s.rms_weight, EPS,
                                        layer_residual_add=s.routed if add else None, diagnostics=False, options=opts)
    w = (s.res_weight, s.rms_weight, s.norm_weight, EPS, EPS)
    if add:
        return lambda: attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *w, options=opts)
    return lambda: attnres.attn_res_rmsnorm(s.prefix, s.bank, *w, options=opts)


def run_point(T: int, N: int, H: int, copy_tbs: float, repeats: int, suite: str = "peers",
              regimes: tuple[str, ...] = REGIMES, add: bool = True, mix: bool = False) -> list[dict]:
    """add=False: attn_res_rmsnorm (no addend) at the point instead of the one-addend op; mix: attn_res."""
    nbytes = op_bytes(T, N, H, add)
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    providers = _providers(T, N, H, add=add, mix=mix)
    default_plan = _plan(T, N, H, add, attnres.Options(), mix=mix)
    gpu = torch.cuda.get_device_name(torch.cuda.current_device())
    records = []
    for regime in regimes:
        count = warm_sets(nbytes, l2) if regime == "warm" else rotating_sets(nbytes, minimum=1)
        if count == 0:
            continue
        sets = make_sets(T, N, H, count, seed=T * 100 + N + (regime == "warm"))
        calls = calls_per_graph(count, nbytes)
        graphs = {name: (capture([call(sets[i % count], o, add, mix) for i in range(calls)]), calls)
                  for name, o in providers.items()}
        timings = time_interleaved(graphs, repeats=repeats)
        for name, t in timings.items():
            records.append(record(suite, name, regime, T, N, H, len(sets), copy_tbs, default_plan.kernel, t.as_dict(),
                                  add=add, mix=mix, gpu=gpu))
        del graphs, sets
        torch.cuda.empty_cache()
    return records


def record(suite: str, provider: str, regime: str, T: int, N: int, H: int, sets: int, copy_tbs: float | None,
           default_kernel: str | None, timing: dict, add: bool = True, mix: bool = False,
           gpu: str | None = None) -> dict:
    """One provider's timing at a point, with its bandwidth (over persistent.op_bytes) and, where the copy rate
    of the run is known (copy_tbs > 0), its share of it. The peers' figures are of the one-addend op on an H200:
    they are attached where `gpu` (the device's name) is one."""
    nbytes = op_bytes(T, N, H, add)
    gbps = nbytes / (timing["median_us"] * 1e-6) / 1e9
    same_gpu = gpu is not None and PEERS_GPU in gpu
    peer = PEERS.get((T, N)) if same_gpu and H == H_DEFAULT and add and not mix else None
    return {"suite": suite, "provider": provider, "regime": regime, "T": T, "N": N, "H": H, "add": add,
            **({"op": "attn_res"} if mix else {}), "sets": sets,
            "bytes": nbytes, "gbps": gbps, "copy_tbs": copy_tbs,
            "pct_copy": 100.0 * gbps / (copy_tbs * 1000.0) if copy_tbs else None, "default_kernel": default_kernel,
            "peer_best_us": peer.best_us if peer else None, "peer_best": peer.best if peer else None,
            "peer_vllm_us": peer.vllm_us if peer else None, **timing}


def run(quick: bool = False, H: int = H_DEFAULT, copy_tbs: float | None = None, progress=None,
        repeats: int = 25) -> list[dict]:
    copy_tbs = copy_rate(copy_tbs)
    return measure(points(quick), lambda T, N: run_point(T, N, H, copy_tbs, repeats),
                   lambda T, N: f"peers T={T} N={N}", progress)


# ------------------------------------------------------------------------------------------- reading records
def _peer_records(records):
    return [r for r in records if r.get("suite") == "peers"]


def comparison(records: list[dict]) -> list[dict]:
    """One row per point with a peer figure: the default options' warm figure (cold where the point has no warm
    regime) against the best peer's, ratio = ours / peer (< 1: ahead)."""
    rec = _peer_records(records)
    rows = []
    for (T, N, H) in sorted({(r["T"], r["N"], r["H"]) for r in rec}):
        mine = {r["regime"]: r for r in rec if (r["T"], r["N"], r["H"]) == (T, N, H)
                and r["provider"] == "attnres/default"}
        ours = mine.get("warm") or mine.get("cold")
        if ours is None or ours.get("peer_best_us") is None:
            continue
        rows.append({"T": T, "N": N, "H": H, "regime": ours["regime"], "ours_us": ours["median_us"],
                     "kernel": ours["default_kernel"], "peer_us": ours["peer_best_us"], "peer": ours["peer_best"],
                     "ratio": ours["median_us"] / ours["peer_best_us"]})
    return rows


def target(records: list[dict]) -> tuple[str, str, str, bool] | None:
    """The kernels issue's 'ahead of the best Hopper kernel at every point of its table' (H = 7168, the default
    options), against the peers' figures of that run."""
    rows = [r for r in comparison(records) if r["H"] == H_DEFAULT]
    if not rows:
        return None
    behind = [r for r in rows if r["ratio"] >= 1.0]
    worst = max(rows, key=lambda r: r["ratio"])
    measured = (f"ahead at {len(rows) - len(behind)} of {len(rows)} points; worst {worst['ratio']:.2f}x the peer at "
                f"T={worst['T']} N={worst['N']} ({worst['ours_us']:.2f} vs {worst['peer_us']:.2f} us)")
    return ("peers", "ahead of the best Hopper kernel at every point of the kernels issue's table (default options)",
            measured, not behind)


def _fmt(us: float) -> str:
    return f"{us:.2f}" if us < 100 else f"{us:.1f}"


def summary(records: list[dict]) -> list[str]:
    """Per point: every provider's µs in each regime, the default's kernel, % of the copy rate (cold), and the
    peers' figures with the default's ratio to the best."""
    rec = _peer_records(records)
    if not rec:
        return []
    cell = {(r["T"], r["N"], r["H"], r["regime"], r["provider"]): r for r in rec}
    names = ["attnres/default"] + [f"attnres/{n}" for n in FORCED]
    ratio = {(r["T"], r["N"], r["H"]): r["ratio"] for r in comparison(records)}
    lines = ["peers: µs per call, one addend (warm / cold L2); default = Options(); the peers' warm-L2 figures from "
             f"the kernels issue's run (an {PEERS_GPU}'s: compared on an {PEERS_GPU} only)"]
    lines.append(f"{'T':>6} {'N':>3}  {'kernel':<11}" + "".join(f"{n.split('/')[1]:>18}" for n in names)
                 + f"{'cold % copy':>12}{'best peer':>10}{'vLLM':>8}{'ours/peer':>10}")
    for (T, N, H) in sorted({(r["T"], r["N"], r["H"]) for r in rec}):
        row = f"{T:6d} {N:3d}  "
        default = cell.get((T, N, H, "cold", "attnres/default"))
        row += f"{(default or {}).get('default_kernel', '-'):<11}"
        for n in names:
            got = [cell.get((T, N, H, g, n)) for g in REGIMES]
            row += " / ".join(_fmt(g["median_us"]) if g else "-" for g in got).rjust(18)
        row += (f"{default['pct_copy']:.0f}%" if default and default["pct_copy"] is not None else "-").rjust(12)
        best, vllm = (default["peer_best_us"], default["peer_vllm_us"]) if default else (None, None)
        row += (_fmt(best) if best else "-").rjust(10) + (_fmt(vllm) if vllm else "-").rjust(8)
        row += (f"{ratio[(T, N, H)]:.2f}x" if (T, N, H) in ratio else "-").rjust(10)
        lines.append(row)
    return lines
