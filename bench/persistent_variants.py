"""The persistent kernel's geometry variants (python -m bench persistent --variants): one run measures
every variant of attnres._persistent_tuning interleaved, at T in {4096, 16384} x N in {2, 9} (--tokens and
--candidates choose others), with the addend (--no-add: without it), H = 7168 by default, against the per-token
kernel and the copy floor of the same run (floors.copy_bandwidth_tbs: the faster of copy_ and an SM copy kernel,
after a warm-up).

The variants (docs/performance.md, "Persistent kernel", predicts each):
  default     the plan: two blocks per SM where that geometry exists (H = 7168: 8 slots each up to N = 14), else
              one; one pass wherever a token's rows fit the ring;
  one_block   one block per SM, the deepest ring (16 slots at H = 7168), one pass where it fits;
  spare1      one block per SM, a ring of exactly a token's rows + 1 slot (one pass, nothing more to prefetch);
  two_pass    one block per SM, the deepest ring, every row streamed twice (released right after scoring);
  half_ring   one block per SM with the ring two_blocks gets (8 slots at H = 7168);
  two_blocks  two blocks per SM, each with half the SM's shared memory (8 slots; two passes at N = 9);
  two_blocks_two_pass  two blocks per SM, every row streamed twice (what one pass saves at N <= 7).

Every variant's updated and output are compared bit for bit with the default geometry's and with the per-token
kernel's at every point (same inputs); the run exits non-zero on a difference. Reported per variant: µs per
call, GB/s over the op's bytes (persistent.op_bytes) and that as a share of the copy floor."""

from __future__ import annotations

import torch

import attnres
from attnres import _persistent_tuning as tuning
from attnres.bench.timing import capture, rotating_sets, time_interleaved
from attnres.bench.workloads import EPS, make_sets

from .grid import copy_rate, measure
from .persistent import H_DEFAULT, op_bytes

TOKENS = (4096, 16384)
CANDIDATES = (2, 9)
NAMES = ("default", "one_block", "spare1", "two_pass", "half_ring", "two_blocks", "two_blocks_two_pass")
PER_TOKEN = "attnres/per_token"
MIN_CALLS = 4  # calls per graph: a replay of one ~100 µs call is too short to time alone


def points(tokens=TOKENS, candidates=CANDIDATES, add: bool = True) -> list[tuple[int, int, bool]]:
    return [(T, N, add) for N in candidates for T in tokens]


def variants(T: int, N: int, H: int, add: bool, device="cuda") -> list[tuple[tuple[str, tuning.Variant], object]]:
    """The variants of a point with their plans; the ones the plan declines are left out (with the reason in the
    plan, for the caller to report)."""
    rows = N + (1 if add else 0)
    two = tuning.Variant("two_blocks", blocks_per_sm=2)
    two_slots = tuning.plan(two, tokens=T, candidates=N, hidden=H, add=add, device=device).slots
    out = []
    for v in (tuning.Variant("default"), tuning.Variant("one_block", blocks_per_sm=1),
              tuning.Variant("spare1", blocks_per_sm=1, slots=rows + 1),
              tuning.Variant("two_pass", blocks_per_sm=1, passes=2),
              tuning.Variant("half_ring", blocks_per_sm=1, slots=two_slots), two,
              tuning.Variant("two_blocks_two_pass", blocks_per_sm=2, passes=2)):
        out.append((v, tuning.plan(v, tokens=T, candidates=N, hidden=H, add=add, device=device)))
    return out


def _geometry(plan) -> dict:
    return {"blocks": plan.blocks, "blocks_per_sm": plan.blocks_per_sm, "threads": plan.threads,
            "slots": plan.slots, "passes": plan.passes, "smem_bytes": plan.smem_bytes}


def same_bits(a, b) -> bool:
    """The two tensors hold the same bf16 bit patterns (shape included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def run_point(T: int, N: int, H: int, add: bool, *, pdl: bool, copy_tbs: float, repeats: int) -> list[dict]:
    nbytes = op_bytes(T, N, H, add)
    sets = make_sets(T, N, H, rotating_sets(nbytes, minimum=1), seed=T * 100 + N + 7 * add)
    calls = [sets[i % len(sets)] for i in range(max(MIN_CALLS, len(sets)))]
    w = lambda s: (s.res_weight, s.rms_weight, s.norm_weight, EPS, EPS)  # noqa: E731
    per_token_opts = attnres.Options(topology="per_token", pdl=pdl)

    def per_token(s):  # (updated or None, output), as the persistent op returns them
        if add:
            return attnres.attn_res_add_rmsnorm(s.prefix, s.routed, s.bank, *w(s), options=per_token_opts)
        return None, attnres.attn_res_rmsnorm(s.prefix, s.bank, *w(s), options=per_token_opts)

    accepted = [(v, p) for v, p in variants(T, N, H, add) if p.accepted]
    fns = {f"attnres/persistent:{v.name}": (lambda s, v=v: tuning.call(v, s.prefix, s.bank, *w(s), pdl=pdl,
                                                                        layer_residual_add=s.routed if add else None))
           for v, _ in accepted}
    fns[PER_TOKEN] = per_token

    # Bits first, eagerly on the first set: every variant against the default geometry and the per-token kernel.
    want = [t.clone() for t in per_token(sets[0]) if t is not None]
    bits = {}
    for name, fn in fns.items():
        got = [t for t in fn(sets[0]) if t is not None]
        bits[name] = len(got) == len(want) and all(same_bits(a, b) for a, b in zip(got, want))
    torch.cuda.synchronize()

    graphs = {name: (capture([lambda s=s, fn=fn: fn(s) for s in calls]), len(calls)) for name, fn in fns.items()}
    timings = time_interleaved(graphs, repeats=repeats)
    plans = {f"attnres/persistent:{v.name}": p for v, p in accepted}
    declined = {f"attnres/persistent:{v.name}": p.decline for v, p in variants(T, N, H, add) if not p.accepted}
    records = []
    for name, t in timings.items():
        gbps = nbytes / (t.median_us * 1e-6) / 1e9
        plan = plans.get(name)
        records.append({
            "suite": "persistent_variants", "provider": name, "variant": name.split(":", 1)[1] if plan else None,
            "T": T, "N": N, "H": H, "add": add, "pdl": pdl, "sets": len(sets), "bytes": nbytes,
            "gbps": gbps, "copy_tbs": copy_tbs, "pct_copy": 100.0 * gbps / (copy_tbs * 1000.0),
            "geometry": _geometry(plan) if plan else None, "bitwise_equal": bits[name], **t.as_dict()})
    for name, why in declined.items():
        records.append({"suite": "persistent_variants", "provider": name, "variant": name.split(":", 1)[1],
                        "T": T, "N": N, "H": H, "add": add, "pdl": pdl, "declined": why})
    return records


def run(H: int = H_DEFAULT, pdl: bool = True, copy_tbs: float | None = None, progress=None, repeats: int = 25,
        tokens=TOKENS, candidates=CANDIDATES, add: bool = True) -> list[dict]:
    copy_tbs = copy_rate(copy_tbs)
    return measure(points(tokens, candidates, add),
                   lambda T, N, add: run_point(T, N, H, add, pdl=pdl, copy_tbs=copy_tbs, repeats=repeats),
                   lambda T, N, add: f"persistent variants T={T} N={N}", progress, empty_cache=True)


# ------------------------------------------------------------------------------------------- reading records
def _records(records):
    return [r for r in records if r.get("suite") == "persistent_variants"]


def differing(records: list[dict]) -> list[tuple[int, int, int, str]]:
    """(T, N, H, provider) of every measured variant whose bits differ from the per-token kernel's."""
    return sorted((r["T"], r["N"], r["H"], r["provider"]) for r in _records(records)
                  if "declined" not in r and not r["bitwise_equal"])


def token_time_us(r: dict) -> float | None:
    """µs per token per block (the model's τ, docs/performance.md): the call's time over the rounds of tokens
    each block runs (ceil(T / blocks)); None for the per-token kernel and declined variants."""
    g = r.get("geometry")
    if not g or "median_us" not in r:
        return None
    return r["median_us"] / -(-r["T"] // g["blocks"])


def model_fit(records: list[dict]) -> dict[tuple[str, int, int, bool], tuple[float, float]]:
    """(variant, T, H, add) -> (c_row, c_fix) in µs from τ = R c_row + c_fix through the two smallest and largest
    N measured (R = N + 1 with the addend, N without): the per-row and the fixed per-token cost of a block."""
    tau = {}
    for r in _records(records):
        t = token_time_us(r)
        if t is not None:
            tau.setdefault((r["variant"], r["T"], r["H"], r["add"]), {})[r["N"] + (1 if r["add"] else 0)] = t
    out = {}
    for key, by_rows in tau.items():
        if len(by_rows) >= 2:
            lo, hi = min(by_rows), max(by_rows)
            c_row = (by_rows[hi] - by_rows[lo]) / (hi - lo)
            out[key] = (c_row, by_rows[lo] - lo * c_row)
    return out


def summary(records: list[dict]) -> list[str]:
    """Per point: each variant's geometry, µs, µs per token per block, share of the copy floor and speed-up over
    the default; then the model's fit per variant."""
    rec = _records(records)
    lines = []
    for key in sorted({(r["H"], r["N"], r["T"], r["add"]) for r in rec}):
        H, N, T, add = key
        here = [r for r in rec if (r["H"], r["N"], r["T"], r["add"]) == key]
        base = next((r for r in here if r.get("variant") == "default" and "median_us" in r), None)
        copy = next((r["copy_tbs"] for r in here if "copy_tbs" in r), None)
        lines.append(f"persistent variants T={T} N={N} H={H} {'add' if add else 'no add'}"
                     + (f" (copy floor {copy:.2f} TB/s)" if copy else ""))
        for r in here:
            if "declined" in r:
                lines.append(f"  {r['provider']:<32} declined: {r['declined']}")
                continue
            g = r["geometry"]
            shape = f"{g['blocks_per_sm']}x{g['slots']} slots, {g['passes']} pass" if g else "split_k"
            speed = f", {base['median_us'] / r['median_us']:.2f}x default" if base else ""
            bits = "" if r["bitwise_equal"] else "  BITS DIFFER"
            tau = token_time_us(r)
            per_token = f", {tau:.2f} us/token/block" if tau is not None else ""
            lines.append(f"  {r['provider']:<32} {shape:<22} {r['median_us']:9.1f} us "
                         f"(p10-p90 {r['p10_us']:.1f}-{r['p90_us']:.1f}) {r['pct_copy']:5.1f}% of copy{per_token}"
                         f"{speed}{bits}")
    for (variant, T, H, add), (c_row, c_fix) in sorted(model_fit(records).items()):
        lines.append(f"model fit {variant} T={T} H={H}: {c_row:.3f} us per row + {c_fix:.2f} us per token and block")
    return lines
