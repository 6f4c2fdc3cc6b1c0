"""The automatic topology's grid (python -m bench topology): attn_res_add_rmsnorm with one addend under
the default options and on every kernel the call can run on, forced (split_k; single_cta for N <= 4; the
persistent kernel), at T in {128, 256, 512, 1024, 2048, 4096} x N = 3..16, H = 7168, cold L2 (the project's
harness: rotating sets past twice the L2, peers.calls_per_graph calls per graph), all of a point interleaved.

It is the measurement behind tuning::automatic_persistent_min_tokens (cpp/src/plan_tuning.hpp): the
persistent kernel's time grows with N, split_k's with its candidate bucket, so which is faster depends on both.
Read from the records: per point the fastest forced kernel and the default's time over it; the check that the
default is within TOLERANCE of the fastest at every point (N <= 2 is the streaming single_cta's rule, measured
by the peers and decode suites)."""

from __future__ import annotations

from .peers import FORCED, H_DEFAULT, run_point

TOKENS = (128, 256, 512, 1024, 2048, 4096)
CANDIDATES = tuple(range(3, 17))
QUICK_TOKENS = (256, 1024, 4096)
QUICK_CANDIDATES = (4, 6, 9, 10, 12)
TOLERANCE = 0.03


def points(quick: bool = False) -> list[tuple[int, int]]:
    tokens, cands = (QUICK_TOKENS, QUICK_CANDIDATES) if quick else (TOKENS, CANDIDATES)
    return [(T, N) for T in tokens for N in cands]


def run(quick: bool = False, H: int = H_DEFAULT, copy_tbs: float | None = None, progress=None,
        repeats: int = 25) -> list[dict]:
    """copy_tbs: the run's copy rate for the records' pct_copy (None: not recorded)."""
    records = []
    pts = points(quick)
    for i, (T, N) in enumerate(pts):
        records += run_point(T, N, H, copy_tbs, repeats, suite="topology", regimes=("cold",))
        if progress:
            progress(i + 1, len(pts), f"topology T={T} N={N}")
    return records


# ------------------------------------------------------------------------------------------- reading records
def rows(records: list[dict]) -> list[dict]:
    """Per (T, N, H): the default's kernel and time, the fastest forced kernel and its time, ratio = default / fastest."""
    rec = [r for r in records if r.get("suite") == "topology" and r.get("regime") == "cold"]
    out = []
    for key in sorted({(r["T"], r["N"], r["H"]) for r in rec}):
        at = {r["provider"]: r for r in rec if (r["T"], r["N"], r["H"]) == key}
        default = at.get("attnres/default")
        forced = {p.split("/", 1)[1]: r["median_us"] for p, r in at.items() if p != "attnres/default"}
        if default is None or not forced:
            continue
        best = min(forced, key=forced.get)
        out.append({"T": key[0], "N": key[1], "H": key[2], "kernel": default["default_kernel"],
                    "default_us": default["median_us"], "best": best, "best_us": forced[best],
                    "ratio": default["median_us"] / forced[best], "forced": forced})
    return out


def target(records: list[dict]) -> tuple[str, str, str, bool] | None:
    got = rows(records)
    if not got:
        return None
    worst = max(got, key=lambda r: r["ratio"])
    slow = [r for r in got if r["ratio"] > 1 + TOLERANCE]
    measured = (f"within {100 * TOLERANCE:.0f}% at {len(got) - len(slow)} of {len(got)} points; worst "
                f"{worst['ratio']:.3f}x at T={worst['T']} N={worst['N']} ({worst['kernel']} {worst['default_us']:.1f} "
                f"vs {worst['best']} {worst['best_us']:.1f} us)")
    return ("topology", f"the default options within {100 * TOLERANCE:.0f}% of the fastest kernel, T = 128..4096, "
            "N = 3..16, one addend", measured, not slow)


def summary(records: list[dict]) -> list[str]:
    got = rows(records)
    if not got:
        return []
    lines = ["topology grid: µs per call, one addend, cold L2; the default's kernel / µs, then each kernel forced; "
             "ratio = default / fastest"]
    names = tuple(FORCED)
    lines.append(f"{'T':>6} {'N':>3}  {'default':<11}{'µs':>9}" + "".join(f"{n:>12}" for n in names) + f"{'ratio':>8}")
    for r in got:
        lines.append(f"{r['T']:6d} {r['N']:3d}  {r['kernel']:<11}{r['default_us']:9.2f}"
                     + "".join((f"{r['forced'][n]:.2f}" if n in r["forced"] else "-").rjust(12) for n in names)
                     + f"{r['ratio']:7.3f}" + ("" if r["ratio"] <= 1 + TOLERANCE else " !"))
    return lines
