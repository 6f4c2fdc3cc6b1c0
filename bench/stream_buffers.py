"""single_cta at large T (python -m bench stream): one run measures the streaming kernel with 2, 3 and 4 token
buffers (attnres._stream_tuning's buffers knob: the token being reduced and 1..3 tokens whose rows are in flight; a
count the N bucket is not built with is recorded as declined) and the token-block kernel (one block per token,
several per SM: the knob's `token_blocks` at every T; at N = 3 also `token_blocks_exact`, its instance built for
exactly three candidates, three blocks per SM), interleaved with the default options and split_k, at T in
{256, 1024, 4096, 16384} x N in {1, 2, 3, 4}, with and without the addend (op "norm": attn_res_add_rmsnorm /
attn_res_rmsnorm; op "mix": attn_res without the fp32 diagnostics, the engines' call), H = 7168, cold L2 (rotating sets
past twice the L2), against the copy floor of the same run.

With `fp8` (--fp8 per_token / block128; op "norm" only) every provider makes the call an FP8 GEMM's producer makes,
fp8=MODE with fp8_only (the codes and scales, no bf16 output; the bytes counted accordingly), compared bit for bit
with split_k's, and `default_bf16` times the bf16 call under the default options beside them (the cost FP8 must stay
within: docs/performance.md, "FP8 output"); its outputs are another call's, so its bits are not compared.

The question it answers (plan_tuning.hpp stream_buffers): where a token's DRAM reads are one row (N = 1 without
the addend) one token in flight per SM is ~14 KB at H = 7168, below what an SM needs in flight to draw its share
of the copy rate; more buffers put more in flight at the cost of shared memory. Every variant's outputs are
compared bit for bit with split_k's (same inputs); the run exits non-zero on a difference."""

from __future__ import annotations

import torch

import attnres
from attnres import _C, _stream_tuning as stream
from attnres.planning import plan_info
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import EPS, make_sets

from .grid import copy_rate, measure
from .persistent import H_DEFAULT, op_bytes
from .persistent_variants import same_bits

TOKENS = (256, 1024, 4096, 16384)
CANDIDATES = (1, 2, 3, 4)
BUFFERS = (2, 3, 4)
MIN_CALLS = 4
OPS = ("norm", "mix")
EXACT_N = 3  # the token-block kernel's exact instance (plan_tuning.hpp kTokenBlocksExactCandidates)


def points(tokens=TOKENS, candidates=CANDIDATES, ops=("norm",)) -> list[tuple[int, int, bool, str]]:
    return [(T, N, add, op) for op in ops for add in (False, True) for N in candidates for T in tokens]


def op_name(add: bool, op: str) -> str:
    """The function a point times: attn_res (op "mix"), else attn_res_add_rmsnorm with the addend, attn_res_rmsnorm
    without."""
    return "attn_res" if op == "mix" else "attn_res_add_rmsnorm" if add else "attn_res_rmsnorm"


def fp8_bytes(T: int, H: int, fp8: str) -> int:
    """What the FP8-only call moves less than the bf16 call: the T x H bf16 output (2 bytes an element) replaced by
    the codes (1 byte) and the fp32 scales (one per token, or per 128 columns)."""
    groups = 1 if fp8 == "per_token" else H // 128
    return T * H - 4 * T * groups


def _options(name: str, pdl: bool):
    if name in ("default", "default_bf16"):
        return attnres.Options(pdl=pdl)
    if name == "split_k":
        return attnres.Options(kernel="split_k", pdl=pdl)
    if name.startswith("token_blocks"):
        return stream.StreamOptions(stream.NEVER, "single_cta", pdl, blocks_min_tokens=stream.ALWAYS,
                                    blocks_exact_n=name == "token_blocks_exact")
    return stream.StreamOptions(0, "single_cta", pdl, buffers=int(name.split(":")[1]))


def run_point(T: int, N: int, H: int, add: bool, op: str = "norm", *, pdl: bool, copy_tbs: float,
              repeats: int, fp8: str | None = None) -> list[dict]:
    # attn_res moves the bytes of the normed op: its mixture takes the output's place (the norm weight aside).
    bf16_bytes = op_bytes(T, N, H, add)
    nbytes = bf16_bytes - (fp8_bytes(T, H, fp8) if fp8 else 0)
    sets = make_sets(T, N, H, rotating_sets(nbytes, minimum=1), seed=T * 100 + N + 7 * add)
    calls = [sets[i % len(sets)] for i in range(max(MIN_CALLS, len(sets)))]
    names = ["default", "split_k", "token_blocks"] + ["token_blocks_exact"] * (N == EXACT_N) + \
        [f"buffers:{b}" for b in BUFFERS] + ["default_bf16"] * (fp8 is not None)
    opts, declined = {}, {}
    for n in names:
        o = _options(n, pdl)
        try:  # a count the N bucket is not built with: recorded as declined
            attnres.plan(op_name(add, op), tokens=T, candidates=N, hidden=H, device="cuda", add=add,
                         fp8=None if n == "default_bf16" else fp8, options=o)
            opts[n] = o
        except attnres.ArgumentError as e:
            declined[n] = str(e)

    def fn(s, o, fp8_mode=fp8):
        if op == "mix":
            r = attnres.attn_res(s.prefix, s.bank, s.res_weight, s.rms_weight, EPS,
                                 layer_residual_add=s.routed if add else None, diagnostics=False, options=o)
            return r if isinstance(r, tuple) else (r,)
        w = (s.res_weight, s.rms_weight, s.norm_weight, EPS, EPS)
        kw = {"fp8": fp8_mode, "fp8_only": True} if fp8_mode else {}
        if add:
            return attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *w, options=o, **kw)
        r = attnres.attn_res_rmsnorm(s.prefix, s.bank, *w, options=o, **kw)
        return r if isinstance(r, tuple) else (r,)

    def variant(n):  # the call provider n makes: default_bf16 the bf16 call, every other one the point's
        return lambda s, o: fn(s, o, None if n == "default_bf16" else fp8)

    plans = {}
    for n, o in opts.items():
        variant(n)(sets[0], o)
        plans[n] = plan_info(_C._last_launch()[0])  # what ran
    want = [t.clone() for t in fn(sets[0], opts["split_k"])]
    bits = {n: None if n == "default_bf16" else all(same_bits(a, b) for a, b in zip(fn(sets[0], o), want))
            for n, o in opts.items()}
    torch.cuda.synchronize()
    graphs = {n: (capture([lambda s=s, o=o, f=variant(n): f(s, o) for s in calls]), len(calls))
              for n, o in opts.items()}
    timings = time_interleaved(graphs, repeats=repeats)
    records = []
    for n, t in timings.items():
        moved = bf16_bytes if n == "default_bf16" else nbytes
        gbps = moved / (t.median_us * 1e-6) / 1e9
        p = plans[n]
        records.append({"suite": "stream_buffers", "provider": n, "T": T, "N": N, "H": H, "add": add, "op": op,
                        "fp8": None if n == "default_bf16" else fp8,
                        "pdl": pdl, "sets": len(sets), "bytes": moved, "gbps": gbps, "copy_tbs": copy_tbs,
                        "pct_copy": 100.0 * gbps / (copy_tbs * 1000.0), "bitwise_equal": bits[n],
                        "plan": {"kernel": p.kernel, "route": p.route, "slots": p.slots, "smem_bytes": p.smem_bytes,
                                 "threads": p.threads} if p else None, **t.as_dict()})
    records += [{"suite": "stream_buffers", "provider": n, "T": T, "N": N, "H": H, "add": add, "op": op, "pdl": pdl,
                 "declined": why} for n, why in declined.items()]
    return records


def run(H: int = H_DEFAULT, pdl: bool = True, copy_tbs: float | None = None, progress=None, repeats: int = 25,
        tokens=TOKENS, candidates=CANDIDATES, ops=("norm",), fp8: str | None = None) -> list[dict]:
    copy_tbs = copy_rate(copy_tbs)
    return measure(points(tokens, candidates, ops),
                   lambda T, N, add, op: run_point(T, N, H, add, op, pdl=pdl, copy_tbs=copy_tbs, repeats=repeats,
                                                   fp8=fp8),
                   lambda T, N, add, op: f"stream buffers {op_name(add, op)} T={T} N={N}", progress, empty_cache=True)


def _records(records):
    return [r for r in records if r.get("suite") == "stream_buffers"]


def differing(records: list[dict]) -> list[tuple[int, int, bool, str, str]]:
    """(T, N, add, op, provider) of every variant whose bits differ from split_k's."""
    return sorted((r["T"], r["N"], r["add"], r.get("op", "norm"), r["provider"]) for r in _records(records)
                  if "declined" not in r and r["bitwise_equal"] is False)


def summary(records: list[dict]) -> list[str]:
    """Per point: each variant's µs, share of the copy floor and speed-up over two buffers."""
    rec = _records(records)
    lines = []
    for key in sorted({(r.get("op", "norm"), r["add"], r["N"], r["T"]) for r in rec}):
        op, add, N, T = key
        here = [r for r in rec if (r.get("op", "norm"), r["add"], r["N"], r["T"]) == key]
        base = next((r for r in here if r["provider"] == "buffers:2"), None)
        copy = next((r["copy_tbs"] for r in here if "copy_tbs" in r), None)
        fp8 = next((r["fp8"] for r in here if r.get("fp8")), None)
        lines.append(f"stream buffers {'attn_res ' if op == 'mix' else ''}T={T} N={N} {'add' if add else 'no add'}"
                     + (f" fp8 {fp8} (FP8-only)" if fp8 else "") + (f" (copy floor {copy:.2f} TB/s)" if copy else ""))
        for r in here:
            if "declined" in r:
                lines.append(f"  {r['provider']:<10} declined: {r['declined']}")
                continue
            p = r["plan"] or {}
            shape = (f"{p.get('kernel')}/{p.get('route')}" + (f" {p.get('slots')} buffers" if p.get("slots") else "")
                     if p else "")
            speed = f", {base['median_us'] / r['median_us']:.3f}x two buffers" if base else ""
            lines.append(f"  {r['provider']:<10} {shape:<32} {r['median_us']:9.2f} us (p10-p90 {r['p10_us']:.1f}-"
                         f"{r['p90_us']:.1f}) {r['pct_copy']:5.1f}% of copy{speed}"
                         f"{'  BITS DIFFER' if r['bitwise_equal'] is False else ''}")
    return lines
