"""One point of tools/engines/bench_sglang.py: inputs, the correctness call each way, the CUDA-graph timings."""

from __future__ import annotations

import torch

from attnres.bench.timing import capture, rotating_sets, time_interleaved

B = torch.bfloat16
BANK_ROWS = 9  # Kimi K3's bank: up to 8 snapshots + room for the next one


def _modules(ar, H: int, gen: torch.Generator):
    """Score projection and norms as SGLang's K3 layer builds them, weights random; get_cw warmed (K3 does it
    after loading, so no cached multiply is recorded into a graph)."""
    proj = ar.ReplicatedLinear(H, 1).to("cuda")
    score_norm, out_norm = ar.RMSNorm(H, eps=1e-6).to("cuda"), ar.RMSNorm(H, eps=1e-6).to("cuda")
    with torch.no_grad():
        proj.weight.copy_(0.02 * torch.randn(1, H, generator=gen, device="cuda"))
        score_norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=gen, device="cuda"))
        out_norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=gen, device="cuda"))
    ar.get_cw(proj, score_norm)
    ar.get_cw(proj, score_norm, dtype=B)
    return proj, score_norm, out_norm


def _set(T: int, H: int, add: bool, gen: torch.Generator) -> dict:
    r = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(B)  # noqa: E731
    return {"prefix": r(T, H), "add": r(T, H) if add else None, "bank": r(T, BANK_ROWS, H)}


def _caller(entry: str, fn, nvb: int, mods):
    proj, score_norm, out_norm = mods
    if entry in ("_aggregate", "_aggregate_fused"):
        return lambda s: fn(s["prefix"], s["bank"], nvb, proj, score_norm, out_norm)
    if entry == "_aggregate_fused_add":
        return lambda s: fn(s["prefix"], s["add"], s["bank"], nvb, proj, score_norm, out_norm)
    return lambda s: fn(s["prefix"], s["bank"], nvb, proj, score_norm)


def _mix_only(ar, entry: str, nvb: int, mods):
    """SGLang's path without its output norm: what it costs at least, whatever RMSNorm kernel SGLang has."""
    proj, score_norm, _ = mods

    def call(s):
        prefix = s["prefix"] + s["add"] if entry == "_aggregate_fused_add" else s["prefix"]
        return ar._mix_fused(prefix, s["bank"], nvb, proj, score_norm)
    return call


def measure_point(plugin, ar, entry: str, T: int, N: int, H: int, repeats: int, max_sets: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1000 * T + N)
    nvb = N - 1
    mods = _modules(ar, H, gen)
    add = entry == "_aggregate_fused_add"
    hooked = _caller(entry, getattr(ar, entry), nvb, mods)
    sglang = _caller(entry, plugin.original(entry), nvb, mods)
    mix = _mix_only(ar, entry, nvb, mods)

    # Correctness on one set: same inputs, the bank and the inputs must come out untouched.
    s = _set(T, H, add, gen)
    before = {k: v.clone() for k, v in s.items() if v is not None}
    plugin.reset_stats()
    got = hooked(s)
    took = plugin.stats()
    with plugin.sglang_functions():
        want = sglang(s)
    torch.cuda.synchronize()
    row = {"entry": entry, "tokens": T, "candidates": N, "hidden": H,
           "attnres_path": took["attnres_calls"] == {entry: 1}, "fallbacks": took["fallbacks"]}
    g, w = (got[0], want[0]) if add else (got, want)
    d = g.double() - w.double()
    row["max_abs_diff"] = float(d.abs().max())
    row["rel_l2"] = float(d.norm() / w.double().norm().clamp_min(1e-30))
    row["cosine"] = float(torch.nn.functional.cosine_similarity(g.double().flatten(), w.double().flatten(), dim=0))
    row["prefix_bitwise"] = bool(torch.equal(got[1], want[1])) if add else True
    row["bank_bitwise"] = all(torch.equal(s[k], v) for k, v in before.items())
    if not row["attnres_path"]:
        row.update(attnres=None, sglang=None, sglang_mix_only=None)
        return row

    per_set = sum(v.numel() * v.element_size() for v in before.values())
    sets = [s] + [_set(T, H, add, gen) for _ in range(min(max_sets, rotating_sets(per_set)) - 1)]
    graphs = {"attnres": (capture([lambda x=x: hooked(x) for x in sets]), len(sets))}
    with plugin.sglang_functions():
        graphs["sglang"] = (capture([lambda x=x: sglang(x) for x in sets]), len(sets))
        graphs["sglang_mix_only"] = (capture([lambda x=x: mix(x) for x in sets]), len(sets))
    timings = time_interleaved(graphs, repeats=repeats)
    row.update({name: t.as_dict() for name, t in timings.items()})
    row["sets"] = len(sets)
    return row
