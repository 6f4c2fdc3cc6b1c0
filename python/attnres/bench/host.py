"""The host cost of one eager call: what an engine that runs the ops outside CUDA graphs (prefill, eager modes)
pays per call on the CPU, 187 times per decode step of Kimi K3.

Calls are issued back to back without synchronisation and timed on the host (time.perf_counter over many
calls, median of interleaved rounds), so the figure is the Python + dispatch + validation + plan + launch cost, not the
kernel's. The two references come from the same run: an eager PyTorch add and rms_norm (two ops), and
torch.empty_like (one allocation). On the CPU backend the figure includes the op's computation (tiny shapes).
"""

from __future__ import annotations

import statistics
import time

import torch

import attnres

T, K, H = 1, 8, 7168  # T = 1, N = 9, Kimi K3 width
TARGET_US = 15.0


def _round_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def cases(device: str, hidden: int = H) -> dict:
    """name -> zero-argument callable, on `device` (inputs built once)."""
    g = torch.Generator().manual_seed(0)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
    p, a, a2, bank = bf(T, hidden), bf(T, hidden), bf(T, hidden), bf(K, T, hidden)
    w = [bf(hidden) for _ in range(3)]
    out = (torch.empty_like(p), torch.empty_like(p))
    ops = torch.ops.attnres
    return {
        "attn_res_add_rmsnorm (two addends)":
            lambda: attnres.attn_res_add_rmsnorm(p, a, bank, *w, 1e-5, 1e-5, layer_residual_add2=a2),
        "attn_res_add_rmsnorm (two addends, out=)":
            lambda: attnres.attn_res_add_rmsnorm(p, a, bank, *w, 1e-5, 1e-5, layer_residual_add2=a2, out=out),
        "attn_res_add_rmsnorm (two addends, fp8 block128)":
            lambda: attnres.attn_res_add_rmsnorm(p, a, bank, *w, 1e-5, 1e-5, layer_residual_add2=a2, fp8="block128"),
        "attn_res_add_rmsnorm (two addends, FP8-only)":
            lambda: attnres.attn_res_add_rmsnorm(p, a, bank, *w, 1e-5, 1e-5, layer_residual_add2=a2, fp8="block128",
                                                 fp8_only=True),
        "attn_res_rmsnorm": lambda: attnres.attn_res_rmsnorm(p, bank, *w, 1e-5, 1e-5),
        "attn_res (addend, no diagnostics)":
            lambda: attnres.attn_res(p, bank, w[0], w[1], 1e-5, layer_residual_add=a, diagnostics=False),
        "torch.ops.attnres.attn_res_add_rmsnorm": lambda: ops.attn_res_add_rmsnorm(p, a, a2, bank, *w, 1e-5, 1e-5),
        "reference: torch add + rms_norm":
            lambda: torch.nn.functional.rms_norm(p + a, (hidden,), w[2], 1e-5),
        "reference: torch.empty_like": lambda: torch.empty_like(p),
    }


def run(device: str = "cuda", calls: int = 2000, rounds: int = 7, progress=None) -> list[dict]:
    """Each case's median over `rounds` rounds of `calls` calls; the rounds of the cases interleave (one round of
    every case, then the next), so a change in the host's speed during the run reaches every case alike."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    items = list(cases(device).items())
    for _, fn in items:
        _round_us(fn, max(calls // 10, 10))  # warm-up
    sync()
    times: dict[str, list[float]] = {name: [] for name, _ in items}
    for r in range(rounds):
        if progress:
            progress(r, rounds, f"round {r + 1}")
        for name, fn in items:
            times[name].append(_round_us(fn, calls))
            sync()  # between rounds only: the queue must not fill
    return [{"suite": "host", "case": name, "device": device, "T": T, "N": K + 1, "H": H,
             "host_us": statistics.median(times[name])} for name, _ in items]


def summary(records: list[dict]) -> list[str]:
    rows = [r for r in records if r.get("suite") == "host"]
    lines = [f"host {r['case']:<50} {r['host_us']:7.2f} us per call" for r in rows]
    main = [r for r in rows if r["case"] == "attn_res_add_rmsnorm (two addends)"]
    if main:
        met = main[0]["host_us"] <= TARGET_US
        lines.append(f"host cost target <= {TARGET_US} us ({main[0]['device']}): {main[0]['host_us']:.2f} -> "
                     f"{'met' if met else 'MISSED'}")
    return lines
